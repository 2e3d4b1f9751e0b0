"""Which warm images to copy where, ahead of need (pure: no Ray, no files).

Every image should be held by `1 + copies` live nodes, on as many different hosts as there
are, so losing a host never loses the last copy of a kind. A copy goes to a node of a host
that holds none of that image first, then to the node holding the fewest images; its source
is the holder that sends the fewest copies in this plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    key: str
    src: str
    dst: str

    def to_dict(self) -> dict:
        return {"key": self.key, "from": self.src, "to": self.dst}


def plan_copies(holders: dict[str, set[str]], copies: int, host_of: dict[str, str] | None = None,
                in_flight: set[tuple[str, str]] | None = None,
                avoid: set[tuple[str, str]] | None = None) -> list[Copy]:
    """The copies that bring every key to `1 + copies` holders. `holders`: {live node: keys it
    holds}; `host_of`: {node: host} (default: each node its own host); `in_flight`: (key, node)
    copies under way (counted as held, never a source); `avoid`: (key, node) not to copy to now
    (a copy there failed a moment ago)."""
    host_of = host_of or {}
    host = lambda n: host_of.get(n, n)  # noqa: E731
    skip = (in_flight or set()) | (avoid or set())
    held = {n: set(keys) for n, keys in holders.items()}  # updated as the plan places copies
    coming = {(k, n) for k, n in (in_flight or set()) if n in held}
    sends: dict[str, int] = {n: 0 for n in held}
    plan: list[Copy] = []
    for key in sorted(set().union(*held.values()) if held else set()):
        want = min(1 + max(0, copies), len(held))
        have = sorted(n for n in held if key in held[n])
        for _ in range(want - len(have) - sum(1 for k, _n in coming if k == key)):
            hosts_with = {host(n) for n in held if key in held[n] or (key, n) in coming}
            free = [n for n in held if key not in held[n] and (key, n) not in skip]
            if not free:
                break
            dst = min(free, key=lambda n: (host(n) in hosts_with, len(held[n]), n))
            src = min(have, key=lambda n: (sends[n], n))
            plan.append(Copy(key, src, dst))
            held[dst].add(key)
            sends[src] += 1
    return plan
