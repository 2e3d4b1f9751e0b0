"""A policy: a trigger, a filter and an action, with its own limits; `configs/policies.yaml`
holds a list of them. Each is validated on its own: one invalid policy is reported and the
others load (`load`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relocator.policies.actions import ACTIONS
from relocator.policies.filters import WorkerFilter
from relocator.policies.triggers import TRIGGERS

Trigger = Annotated[Union[tuple(TRIGGERS)], Field(discriminator="kind")]  # type: ignore[valid-type]
Action = Annotated[Union[tuple(ACTIONS)], Field(discriminator="kind")]  # type: ignore[valid-type]
TRIGGER_KINDS = tuple(t.model_fields["kind"].annotation.__args__[0] for t in TRIGGERS)
ACTION_KINDS = tuple(a.model_fields["kind"].annotation.__args__[0] for a in ACTIONS)


class Limits(BaseModel):
    """Hysteresis and budget: a flapping signal must not cause a move storm."""

    model_config = ConfigDict(extra="forbid")

    hold_s: float = Field(0.0, ge=0)  # a condition must hold this long, unbroken, before acting
    cooldown_s: float = Field(300.0, ge=0)  # after acting on a condition, the same one waits this long
    max_moves_per_hour: int = Field(6, ge=0)  # moves, replacements and suspends in any hour


class PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    enabled: bool = True
    trigger: Trigger
    filter: WorkerFilter = Field(default_factory=WorkerFilter)
    action: Action
    limits: Limits = Field(default_factory=Limits)


def _one_line(exc: ValidationError) -> str:
    e = exc.errors()[0]
    where = ".".join(str(p) for p in e.get("loc", ()) if not str(p).endswith("Trigger")
                     and not str(p).endswith("Action"))
    msg = e.get("msg", "").replace("Value error, ", "")
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {msg}{more}" if where else f"{msg}{more}"


def load(doc: Any) -> tuple[list[PolicySpec], list[dict[str, str]]]:
    """(valid policies, [{name, error}] for each invalid one). `doc`: {"policies": [...]} or the
    list itself; a duplicate name is an error of the second one."""
    items = doc.get("policies", []) if isinstance(doc, dict) else doc
    if items is None:
        items = []
    if not isinstance(items, list):
        return [], [{"name": "", "error": "`policies` must be a list"}]
    out: list[PolicySpec] = []
    errors: list[dict[str, str]] = []
    for i, item in enumerate(items):
        name = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
        try:
            spec = PolicySpec.model_validate(item)
        except ValidationError as exc:
            errors.append({"name": str(name), "error": _one_line(exc)})
            continue
        if any(p.name == spec.name for p in out):
            errors.append({"name": spec.name, "error": "duplicate policy name"})
            continue
        out.append(spec)
    return out, errors


def load_file(path: str | Path) -> tuple[list[PolicySpec], list[dict[str, str]]]:
    """`load` of a YAML file; a file that is not YAML is one error (no policy loads)."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        return [], [{"name": "", "error": f"{path}: {str(exc).splitlines()[0]}"}]
    return load(doc)
