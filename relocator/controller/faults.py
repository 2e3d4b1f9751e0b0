"""The faults a relocation may be given (tests, chaos, `relocate --fault`): a failure at the end
of a phase, hooks that act when a phase starts, post-copy knobs. Checked before anything moves."""

from __future__ import annotations

from typing import Any

from relocator.choices import Choice
from relocator.controller.model import PHASES


class PhaseFault(Choice):
    """A failure injected at the end of a phase (`relocate(faults={"dump": True})`)."""

    DUMP = "dump"
    TRANSFER = "transfer"
    RESTORE = "restore"


#: fault hooks that act when a phase starts: {"phase": PHASE, ...}
HOOKS = ("crash", "pause")
#: post-copy knobs for tests and chaos: {"postcopy": {"throttle_bps": 2e8, "stall_s": 2}}: the
#: target's keeper paces the background transfer (a window to act on) / declares a cut sooner
POSTCOPY_KNOBS = ("throttle_bps", "stall_s")


def check_faults(faults: dict[str, Any] | None) -> dict[str, Any]:
    """The faults of one relocation, checked: phase faults by name, hooks with a known phase.
    A wrong name is refused (ValueError naming the valid ones), never ignored."""
    out = dict(faults or {})
    for key, value in out.items():
        if key == "postcopy":
            if not isinstance(value, dict) or any(k not in POSTCOPY_KNOBS or not isinstance(v, (int, float))
                                                  for k, v in value.items()):
                raise ValueError(f"fault 'postcopy' takes numbers for {', '.join(POSTCOPY_KNOBS)}, not {value!r}")
        elif key in HOOKS:
            if not isinstance(value, dict) or value.get("phase") not in PHASES:
                raise ValueError(f"fault {key!r} needs {{'phase': one of {', '.join(PHASES)}}}, not {value!r}")
        elif key not in PhaseFault.values():
            raise ValueError(f"unknown fault {key!r}; valid: {', '.join(PhaseFault.values() + HOOKS + ('postcopy',))}")
    return out


__all__ = ["HOOKS", "POSTCOPY_KNOBS", "PhaseFault", "check_faults"]
