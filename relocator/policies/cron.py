"""A small cron parser: five fields (minute hour day-of-month month day-of-week), each `*`,
a number, a range `a-b`, a list `a,b`, a step `*/n` or `a-b/n`; day-of-week 0-7 (0 and 7:
Sunday). As in cron, when both day fields are restricted a day matches either. No names
(`MON`), no `@daily`: the schedule trigger's own validation rejects them with a clear message."""

from __future__ import annotations

import time
from dataclasses import dataclass

FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7))


def _field(text: str, name: str, lo: int, hi: int) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        rng, _, step_s = part.partition("/")
        step = int(step_s) if step_s.isdigit() else None
        if step_s and (step is None or step < 1):
            raise ValueError(f"cron {name}: bad step in {part!r}")
        if rng == "*":
            a, b = lo, hi
        else:
            a_s, dash, b_s = rng.partition("-")
            if not a_s.isdigit() or (dash and not b_s.isdigit()):
                raise ValueError(f"cron {name}: {part!r} is not a number, range or step")
            a = int(a_s)
            b = int(b_s) if dash else (hi if step else a)
        if not (lo <= a <= b <= hi):
            raise ValueError(f"cron {name}: {part!r} is outside {lo}-{hi}")
        out.update(range(a, b + 1, step or 1))
    return frozenset(out)


@dataclass(frozen=True)
class Cron:
    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool
    any_weekday: bool

    @classmethod
    def parse(cls, text: str) -> "Cron":
        parts = str(text).split()
        if len(parts) != 5:
            raise ValueError(f"cron {text!r}: want 5 fields (minute hour day month weekday), got {len(parts)}")
        sets = [_field(p, name, lo, hi) for p, (name, lo, hi) in zip(parts, FIELDS)]
        weekdays = frozenset(d % 7 for d in sets[4])
        return cls(text, sets[0], sets[1], sets[2], sets[3], weekdays, parts[2] == "*", parts[4] == "*")

    def matches(self, epoch: float, utc: bool = True) -> bool:
        """Whether the minute holding `epoch` is one of the schedule's (UTC unless utc=False)."""
        t = time.gmtime(epoch) if utc else time.localtime(epoch)
        if t.tm_min not in self.minutes or t.tm_hour not in self.hours or t.tm_mon not in self.months:
            return False
        day_ok = t.tm_mday in self.days
        weekday_ok = (t.tm_wday + 1) % 7 in self.weekdays  # tm_wday: Monday = 0
        if self.any_day or self.any_weekday:
            return day_ok and weekday_ok
        return day_ok or weekday_ok
