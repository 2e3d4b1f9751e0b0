"""The filter of a policy: which workers its action applies to (every field optional; all
given ones must hold)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WorkerFilter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engines: list[str] = Field(default_factory=list)  # e.g. [vllm]; empty: any
    models: list[str] = Field(default_factory=list)
    priority_min: int | None = None
    priority_max: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)  # given at `launch --label k=v`; all must match
    gpus_min: float | None = Field(None, ge=0)  # the worker's GPU share
    gpus_max: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ranges(self) -> "WorkerFilter":
        if None not in (self.priority_min, self.priority_max) and self.priority_min > self.priority_max:
            raise ValueError(f"priority_min {self.priority_min} > priority_max {self.priority_max}")
        if None not in (self.gpus_min, self.gpus_max) and self.gpus_min > self.gpus_max:
            raise ValueError(f"gpus_min {self.gpus_min} > gpus_max {self.gpus_max}")
        return self

    def matches(self, w: dict[str, Any]) -> bool:
        prio, gpus = int(w.get("priority") or 0), float(w.get("gpus") or 0)
        labels = w.get("labels") or {}
        return ((not self.engines or w.get("engine") in self.engines)
                and (not self.models or w.get("model") in self.models)
                and (self.priority_min is None or prio >= self.priority_min)
                and (self.priority_max is None or prio <= self.priority_max)
                and (self.gpus_min is None or gpus >= self.gpus_min)
                and (self.gpus_max is None or gpus <= self.gpus_max)
                and all(labels.get(k) == v for k, v in self.labels.items()))

    def select(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [w for w in workers if self.matches(w)]
