"""Options with a fixed set of values: one base class, so every such set refuses a wrong value
the same way (naming the valid ones) wherever it is read: pydantic config, typer CLI, control
calls. Each set itself is defined once, in the module that owns the concept (transfer modes
with the relocation records, placement policies from the planner's registry, ...)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Iterable, Sequence


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


#: the words a list of names takes for every name / for none
ALL_WORDS, NONE_WORDS = ("all", "*"), ("none",)


def parse_names(spec: str | Sequence[str] | None, known: Sequence[str], what: str, *,
                every: Sequence[str] | None = None, why: str = "") -> list[str]:
    """"all", "none", "" or a comma list of names from `known` (None: none). "all" means
    `every` (default `known`). An unknown name: ValueError("unknown <what>(s) 'x'<why>; known:
    a, b")."""
    if spec is None:
        return []
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if len(items) == 1 and items[0] in ALL_WORDS:
        return list(known if every is None else every)
    if items in ([], list(NONE_WORDS)):
        return []
    bad = [i for i in items if i not in known]
    if bad:
        raise ValueError(f"unknown {what}(s) {', '.join(map(repr, bad))}{why}; known: {', '.join(known)}")
    return items


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
