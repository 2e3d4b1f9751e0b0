"""Replica selection policies, registered by name.

A policy sees only the *eligible* replicas of one model (active, not excluded) and an
optional affinity key; it returns one. Policies are pure and synchronous."""

from __future__ import annotations

import hashlib
import itertools
from typing import TYPE_CHECKING, Callable, Sequence

from relocator.choices import registry_choice

if TYPE_CHECKING:
    from .table import Replica

POLICIES: dict[str, type["Policy"]] = {}


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(name: str, **args: object) -> "Policy":
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(**args)  # type: ignore[arg-type]


class Policy:
    name = "base"
    #: whether the router must compute an affinity key for each request (costs a little)
    needs_key = False

    def choose(self, replicas: Sequence["Replica"], key: str | None) -> "Replica":
        raise NotImplementedError


@register_policy("round_robin")
class RoundRobin(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas: Sequence["Replica"], key: str | None) -> "Replica":
        return replicas[next(self._counter) % len(replicas)]


@register_policy("least_in_flight")
class LeastInFlight(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas: Sequence["Replica"], key: str | None) -> "Replica":
        low = min(r.in_flight for r in replicas)
        ties = [r for r in replicas if r.in_flight == low]
        return ties[next(self._counter) % len(ties)] if len(ties) > 1 else ties[0]


def _score(key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest(),
                          "big")


@register_policy("affinity")
class Affinity(Policy):
    """Session/prefix affinity: rendezvous hashing of the affinity key (session header,
    `user`, or the prompt's first characters) over the replicas, so the same session or
    shared prefix lands where its KV cache is. Bounded load: when the preferred replica has
    more than `max_imbalance` requests above the least loaded one, fall back to least
    in-flight. Requests without a key go least in-flight."""

    needs_key = True

    def __init__(self, max_imbalance: int = 8) -> None:
        if max_imbalance < 0:
            raise ValueError("max_imbalance must be >= 0")
        self.max_imbalance = max_imbalance
        self._fallback = LeastInFlight()

    def choose(self, replicas: Sequence["Replica"], key: str | None) -> "Replica":
        if key is None or len(replicas) == 1:
            return self._fallback.choose(replicas, None)
        ranked = sorted(replicas, key=lambda r: _score(key, r.worker_id), reverse=True)
        low = min(r.in_flight for r in replicas)
        for r in ranked:
            if r.in_flight - low <= self.max_imbalance:
                return r
        return self._fallback.choose(replicas, None)


#: the registered policies as a typed choice (router config, `relocator router serve --policy`)
RouterPolicy = registry_choice("RouterPolicy", POLICIES, __name__)
