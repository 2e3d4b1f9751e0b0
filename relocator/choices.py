"""Options with a fixed set of values: one base class, so every such set refuses a wrong value
the same way (naming the valid ones) wherever it is read: pydantic config, typer CLI, control
calls. Each set itself is defined once, in the module that owns the concept (transfer modes
with the relocation records, placement policies from the planner's registry, ...)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Iterable


class Choice(StrEnum):
    """A string enum whose members compare equal to (and serialise as) their values.
    `Mode("x")` with an unknown "x" raises ValueError("unknown mode 'x'; valid: a, b")."""

    @classmethod
    def _missing_(cls, value: object) -> "Choice":
        raise ValueError(f"unknown {cls.label()} {value!r}; valid: {', '.join(cls.values())}")

    @classmethod
    def label(cls) -> str:
        """The class name in words: TransferMode -> "transfer mode"."""
        return re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


def registry_choice(name: str, values: Iterable[str], module: str) -> type[Choice]:
    """A Choice built from a registry's names (assign it to `name` in `module`, so it pickles)."""
    return Choice(name, {re.sub(r"\W", "_", v).upper(): v for v in values}, module=module)  # type: ignore[return-value]


class LogLevel(Choice):
    """Python logging levels, as the CLI and the router process accept them."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"
