"""Triggers: when a policy acts. Each is a pydantic model of its own args (defaults and
validation in the shape of the Kubernetes descheduler's plugins) with `fire(ctx)`, the
conditions true now. Registered by kind in TRIGGERS (an explicit table)."""

from __future__ import annotations

import operator
from datetime import datetime
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relocator.policies.base import Context, Firing
from relocator.policies.cron import Cron

# NVIDIA's Xid catalogue (docs/policies.md has the table and the source):
# the GPU still works but must be reset soon (pending row remap / page retirement, high SBE rate)
DRAIN_XIDS = (63, 64, 92)
# the GPU (or what runs on it) is lost: off the bus, double-bit / uncontained / contained ECC, GSP
FAIL_XIDS = (48, 79, 94, 95, 119, 120)
# the application's own fault (or a follow-up of one): never a reason to move
APP_XIDS = (13, 31, 43, 45, 68, 69)


class GpuState:
    HEALTHY, DRAINING, FAILED = "healthy", "draining", "failed"


class _Trigger(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def fire(self, ctx: Context) -> list[Firing]:  # pragma: no cover - every trigger overrides it
        raise NotImplementedError


class GpuHealthTrigger(_Trigger):
    """NVML facts read by each agent: Xid codes, pending row remaps / retired pages, ECC, heat."""

    kind: Literal["gpu-health"]
    drain_xids: list[int] = Field(default_factory=lambda: list(DRAIN_XIDS))
    fail_xids: list[int] = Field(default_factory=lambda: list(FAIL_XIDS))
    ignore_xids: list[int] = Field(default_factory=lambda: list(APP_XIDS))
    remapped_rows_pending: bool = True  # a pending row remap drains the GPU
    retired_pages_pending: bool = True  # so does a pending page retirement (pre-Ampere)
    remap_failure_fails: bool = True  # a row remap that failed: the GPU is failed
    sbe_max: int | None = Field(None, ge=1)  # volatile single-bit ECC errors above which it drains
    temperature_c_max: float | None = Field(None, gt=0)  # hotter than this: drains

    @model_validator(mode="after")
    def _disjoint(self) -> "GpuHealthTrigger":
        both = set(self.drain_xids) & set(self.fail_xids)
        ignored = (set(self.drain_xids) | set(self.fail_xids)) & set(self.ignore_xids)
        if both or ignored:
            raise ValueError(f"an Xid is in two lists: {sorted(both | ignored)}")
        return self

    def classify(self, gpu: dict[str, Any]) -> tuple[str, str]:
        """(GpuState, why) of one GPU's report."""
        xids = [int(x) for x in gpu.get("xids") or []]
        failed = [x for x in xids if x in self.fail_xids]
        if failed:
            return GpuState.FAILED, f"Xid {failed[0]}"
        if self.remap_failure_fails and gpu.get("remapped_rows_failure"):
            return GpuState.FAILED, "row remap failed"
        draining = [x for x in xids if x in self.drain_xids]
        if draining:
            return GpuState.DRAINING, f"Xid {draining[0]}"
        if self.remapped_rows_pending and gpu.get("remapped_rows_pending"):
            return GpuState.DRAINING, "row remap pending"
        if self.retired_pages_pending and gpu.get("retired_pages_pending"):
            return GpuState.DRAINING, "page retirement pending"
        if self.sbe_max is not None and int(gpu.get("sbe") or 0) > self.sbe_max:
            return GpuState.DRAINING, f"{gpu.get('sbe')} single-bit ECC errors > {self.sbe_max}"
        temp = gpu.get("temperature_c")
        if self.temperature_c_max is not None and temp is not None and float(temp) > self.temperature_c_max:
            return GpuState.DRAINING, f"{temp} C > {self.temperature_c_max} C"
        return GpuState.HEALTHY, ""

    def fire(self, ctx: Context) -> list[Firing]:
        out = []
        for node, report in sorted(ctx.health.items()):
            for gpu in report.get("gpus") or []:
                state, why = self.classify(gpu)
                if state != GpuState.HEALTHY:
                    idx = int(gpu["index"])
                    out.append(Firing(key=f"gpu:{node}/{idx}:{state}", reason=f"GPU {idx} on {node}: {why}",
                                      node=node, gpu=idx, severity=state))
        return out


class NodeNoticeTrigger(_Trigger):
    """"Node N goes away at T": a notice the node's agent reads from a file or an HTTP endpoint
    (a cloud's spot notice, an operator's script)."""

    kind: Literal["node-notice"]
    max_lead_s: float = Field(3600.0, gt=0)  # a notice further ahead than this waits

    def fire(self, ctx: Context) -> list[Firing]:
        out = []
        for node, report in sorted(ctx.health.items()):
            notice = report.get("notice")
            if not notice or notice.get("at") is None:
                continue
            at = float(notice["at"])
            if at - ctx.now <= self.max_lead_s:
                out.append(Firing(key=f"notice:{node}@{int(at)}", node=node, deadline=at,
                                  reason=f"{node} goes away at {at:.0f} ({notice.get('reason') or 'notice'})"))
        return out


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


class WindowTrigger(_Trigger):
    """A maintenance window: from `lead_s` before `start` until `end`, NODE is taken out."""

    kind: Literal["window"]
    node: str
    start: float  # epoch, or an ISO 8601 time
    end: float
    lead_s: float = Field(600.0, ge=0)

    _times = field_validator("start", "end", mode="before")(lambda v: _epoch(v))

    @model_validator(mode="after")
    def _order(self) -> "WindowTrigger":
        if self.end <= self.start:
            raise ValueError("a window's end must be after its start")
        return self

    def fire(self, ctx: Context) -> list[Firing]:
        if self.start - self.lead_s <= ctx.now < self.end:
            return [Firing(key=f"window:{self.node}@{int(self.start)}", node=self.node, deadline=self.start,
                           until=self.end, reason=f"maintenance window on {self.node} {self.start:.0f}-{self.end:.0f}")]
        return []


class ScheduleTrigger(_Trigger):
    """Cron syntax (five fields, UTC unless `utc: false`): fires once in each matching minute."""

    kind: Literal["schedule"]
    cron: str
    utc: bool = True

    @field_validator("cron")
    @classmethod
    def _parse(cls, v: str) -> str:
        Cron.parse(v)
        return v

    def fire(self, ctx: Context) -> list[Firing]:
        if Cron.parse(self.cron).matches(ctx.now, self.utc):
            minute = int(ctx.now // 60 * 60)
            return [Firing(key=f"cron:{minute}", reason=f"schedule {self.cron!r}")]
        return []


#: the series a metric trigger may read (computed by the engine from the controller's facts)
SERIES = ("pending_demands", "pending_demand_age_max_s", "workers_running", "gpus_free", "nodes_lost",
          "gpus_unhealthy")
OPS: dict[str, Callable[[float, float], bool]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt,
                                                  "<=": operator.le}


class MetricTrigger(_Trigger):
    """A threshold on one of our own series, e.g. `pending_demand_age_max_s > 60`; it must hold
    for the policy's `hold_s` before the action runs."""

    kind: Literal["metric"]
    series: Literal[SERIES]  # type: ignore[valid-type]
    op: Literal[">", ">=", "<", "<="] = ">"
    value: float

    def fire(self, ctx: Context) -> list[Firing]:
        v = ctx.series.get(self.series)
        if v is not None and OPS[self.op](float(v), self.value):
            return [Firing(key=f"metric:{self.series}", reason=f"{self.series} = {v:g} {self.op} {self.value:g}")]
        return []


TRIGGERS = (GpuHealthTrigger, NodeNoticeTrigger, WindowTrigger, ScheduleTrigger, MetricTrigger)
