"""Warm images ahead of need (issue 28): which copies the controller plans, and its step."""

from __future__ import annotations

from relocator.controller.warmcopies import FAILED_BACKOFF_S, WarmCopies
from relocator.warm.config import WarmConfig
from relocator.warm.replicate import Copy, plan_copies


def test_each_image_gets_its_copies_on_another_host_first() -> None:
    holders = {"n1": {"k"}, "n2": set(), "n3": set()}
    hosts = {"n1": "h1", "n2": "h1", "n3": "h2"}
    assert plan_copies(holders, 1, hosts) == [Copy("k", "n1", "n3")]  # not n2: same host as n1
    assert plan_copies(holders, 2, hosts) == [Copy("k", "n1", "n3"), Copy("k", "n1", "n2")]


def test_enough_holders_mean_no_copies_and_copies_never_exceed_the_nodes() -> None:
    assert plan_copies({"a": {"k"}, "b": {"k"}}, 1) == []
    assert plan_copies({"a": {"k"}, "b": set()}, 5) == [Copy("k", "a", "b")]
    assert plan_copies({"a": {"k"}}, 1) == []
    assert plan_copies({}, 1) == []


def test_targets_spread_by_images_held_and_sources_by_copies_sent() -> None:
    holders = {"a": {"k1", "k2"}, "b": {"k2"}, "c": set(), "d": {"x", "y"}}
    plan = plan_copies(holders, 1)
    # k1: to c (holds none) from a; k2 has two holders already; x, y: one each, spread
    assert Copy("k1", "a", "c") in plan and not [c for c in plan if c.key == "k2"]
    assert {c.key for c in plan} == {"k1", "x", "y"}
    assert len({c.dst for c in plan if c.key in ("x", "y")}) == 2


def test_in_flight_counts_as_held_and_avoided_nodes_get_nothing() -> None:
    holders = {"a": {"k"}, "b": set(), "c": set()}
    assert plan_copies(holders, 1, in_flight={("k", "b")}) == []
    assert plan_copies(holders, 1, avoid={("k", "b")}) == [Copy("k", "a", "c")]
    assert plan_copies(holders, 1, avoid={("k", "b"), ("k", "c")}) == []


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _copies(holders: dict[str, set[str]], fail: set[str] = frozenset(), cordoned: set[str] = frozenset(),
            cfg: WarmConfig | None = None, busy: list[bool] | None = None):
    events: list[tuple[str, dict]] = []
    fetched: list[tuple[str, str, str]] = []
    clock = _Clock()

    def fetch(dst: str, src: str, key: str) -> dict:
        fetched.append((dst, src, key))
        if dst in fail:
            raise OSError("no room")
        holders[dst].add(key)
        return {"copied": True, "bytes": 10}

    def keys(node: str) -> list[str]:
        if node == "dead":
            raise TimeoutError("no answer")
        return sorted(holders[node])

    wc = WarmCopies(nodes=lambda: list(holders), keys=keys, fetch=fetch,
                    emit=lambda kind, **f: events.append((str(kind.value), f)), cordoned=lambda: set(cordoned),
                    config=lambda: cfg or WarmConfig(), clock=clock, spawn=lambda fn: fn(),
                    busy=lambda: bool(busy and busy[0]))
    return wc, events, fetched, clock


def test_the_step_copies_once_then_waits_for_its_interval() -> None:
    holders = {"a": {"k"}, "b": set(), "dead": set()}
    wc, events, fetched, clock = _copies(holders)
    wc.update()
    assert fetched == [("b", "a", "k")] and events[0][0] == "warm_image_copied"
    assert events[0][1]["src"] == "a" and events[0][1]["dst"] == "b"
    wc.update()  # not due yet
    clock.t += 60
    wc.update()  # due, nothing missing
    assert fetched == [("b", "a", "k")] and wc.last == {"planned": []}


def test_a_failed_copy_is_an_event_and_waits_out_its_backoff() -> None:
    holders = {"a": {"k"}, "b": set()}
    wc, events, fetched, clock = _copies(holders, fail={"b"})
    wc.update()
    assert events[-1][0] == "warm_copy_failed" and "no room" in events[-1][1]["error"]
    clock.t += 60
    wc.update()
    assert len(fetched) == 1  # b is avoided for the backoff
    clock.t += FAILED_BACKOFF_S
    wc.update()
    assert len(fetched) == 2


def test_cordoned_nodes_get_no_copies_and_off_means_off() -> None:
    holders = {"a": {"k"}, "b": set()}
    wc, _events, fetched, _clock = _copies(holders, cordoned={"b"})
    wc.update()
    assert fetched == []
    wc, _events, fetched, _clock = _copies({"a": {"k"}, "b": set()},
                                           cfg=WarmConfig(prefetch={"copies": 0}))
    wc.update()
    assert fetched == [] and "off" in wc.last["why"]


def test_a_lost_worker_goes_where_its_image_is_when_that_node_has_room() -> None:
    from types import SimpleNamespace

    from relocator.controller.workers import WorkerManager

    free = {"a": 0, "b": 2, "c": 2}  # GPUs free; the image is on a (full) and c

    def place(gpus: int, exclude: tuple[str, ...] = ()) -> str | None:
        fits = [n for n in sorted(free) if free[n] >= gpus and n not in exclude]
        return fits[0] if fits else None

    mgr = SimpleNamespace(place=place, kinds={"w": "k"},
                          image_holders=lambda key: ({"a", "c"}, {"a", "b", "c"}) if key == "k" else (set(), set()))
    w = SimpleNamespace(id="w", gpus=1, node="lost")
    assert WorkerManager._place_near_image(mgr, w) == "c"  # not b, the planner's first choice
    free["c"] = 0
    assert WorkerManager._place_near_image(mgr, w) == "b"  # no holder has room: anywhere
    mgr.kinds = {}
    free["c"] = 2
    assert WorkerManager._place_near_image(mgr, w) == "b"  # kind unknown: the planner's choice


def test_prefetch_by_hand_copies_what_the_node_lacks_and_reports_the_rest() -> None:
    holders = {"a": {"k1", "k2"}, "b": {"k2"}, "c": set()}
    wc, _events, fetched, _clock = _copies(holders)
    out = wc.prefetch("b")
    assert [c["key"] for c in out["copied"]] == ["k1"] and out["already"] == ["k2"] and out["failed"] == []
    assert fetched == [("b", "a", "k1")]
    out = wc.prefetch("c", key="k9")
    assert out["failed"] and "no live node holds" in out["failed"][0]["error"]
    for bad in ("zz", "dead"):
        try:
            wc.prefetch(bad)
        except ValueError as exc:
            assert bad in str(exc)
        else:
            raise AssertionError("an unknown node was accepted")


def test_no_copy_starts_while_a_move_or_a_start_is_under_way() -> None:
    busy = [True]
    wc, _events, fetched, _clock = _copies({"a": {"k"}, "b": set()}, busy=busy)
    wc.update()
    assert fetched == [] and "under way" in wc.last["why"]
    busy[0] = False
    wc.update()  # not rescheduled by the skipped round: due at once
    assert fetched == [("b", "a", "k")]
