"""Warm images ahead of need (issue 28): which copies the controller plans, and its step."""

from __future__ import annotations

import threading
import time

from relocator.controller.warmcopies import ANY_NODE, COUNTS, FAILED_BACKOFF_S, WarmCopies, busy_nodes, stored_counter
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
    wc, _events, fetched, clock = _copies({"a": {"k"}, "b": set()}, busy=busy)
    wc.update()
    assert fetched == [] and "under way" in wc.last["why"], wc.last
    busy[0] = False
    wc.update()  # over a moment ago: moves come in bursts, so it waits for a quiet spell
    assert fetched == [] and "waiting for 5 s" in wc.last["why"], wc.last
    clock.t += WarmConfig().prefetch.quiet_s
    wc.update()  # not rescheduled by the skipped rounds: due at once
    assert fetched == [("b", "a", "k")], wc.last


# -- giving way to moves and starts (the copy is cancelled, retried later) ----------------------
class _Agents:
    """A copy that runs until the test's operation begins, then until it is cancelled."""

    def __init__(self, holders: dict[str, set[str]], busy: set[str], begin: str | None = "a",
                 honours_cancel: bool = True) -> None:
        self.holders, self.busy, self.begin, self.honours = holders, busy, begin, honours_cancel
        self.fetched: list[tuple[str, str, str]] = []
        self.cancels: list[tuple[str, str]] = []
        self.events: list[tuple[str, dict]] = []
        self.counts: dict[str, int] = {}
        self.stop = threading.Event()

    def fetch(self, dst: str, src: str, key: str) -> dict:
        self.fetched.append((dst, src, key))
        if len(self.fetched) == 1 and self.begin is not None:
            self.busy.add(self.begin)  # a move begins on that node while the copy runs
            if not self.stop.wait(60):
                raise AssertionError("the copy was never cancelled")
            if self.honours:
                raise RuntimeError(f"warm image {key}: cancelled (a relocation or a start began)")
        self.holders[dst].add(key)
        return {"copied": True, "bytes": 10}

    def cancel(self, dst: str, key: str) -> None:
        self.cancels.append((dst, key))
        self.stop.set()

    def copies(self, scope: str = "cluster", hosts: dict[str, str] | None = None) -> tuple[WarmCopies, _Clock]:
        clock = _Clock()
        cfg = WarmConfig(prefetch={"yield_to": scope})
        wc = WarmCopies(nodes=lambda: list(self.holders), keys=lambda n: sorted(self.holders[n]), fetch=self.fetch,
                        emit=lambda kind, **f: self.events.append((str(kind.value), f)), config=lambda: cfg,
                        host_of=lambda: dict(hosts or {}), clock=clock, spawn=lambda fn: fn(),
                        busy=lambda: set(self.busy), cancel=self.cancel, poll_s=0.01,
                        count=lambda o: self.counts.__setitem__(o, self.counts.get(o, 0) + 1))
        return wc, clock

    def kinds(self) -> list[str]:
        return [k for k, _f in self.events]


def test_a_move_that_begins_cancels_the_running_copy_which_is_retried_at_a_quiet_round() -> None:
    ag = _Agents({"a": {"k"}, "b": set()}, busy=set())
    wc, clock = ag.copies()
    wc.update()
    assert ag.cancels == [("b", "k")], ag.events
    assert ag.kinds() == ["warm_copy_deferred"], ag.events  # not a failure: no backoff, no failed event
    ev = ag.events[0][1]
    assert ev["cancelled"] is True and ev["dst"] == "b" and "on a" in ev["why"], ev
    assert ag.counts == {"deferred": 1} and wc._failed == {} and wc.copying is None
    wc.update()
    assert len(ag.fetched) == 1 and "under way" in wc.last["why"], wc.last  # none starts beside it
    ag.busy.clear()
    clock.t += wc._config().prefetch.quiet_s
    wc.update()  # the move is over and quiet: retried at once (not an interval later)
    assert ag.fetched == [("b", "a", "k"), ("b", "a", "k")] and ag.kinds()[-1] == "warm_image_copied", ag.events
    assert ag.counts == {"deferred": 1, "copied": 1}


def test_the_rest_of_a_round_waits_too_and_never_starts_beside_the_move() -> None:
    ag = _Agents({"a": {"k1", "k2"}, "b": set()}, busy=set())
    wc, _clock = ag.copies()
    wc.update()
    assert len(ag.fetched) == 1, ag.fetched  # k2's copy did not start while the move runs
    deferred = [f for k, f in ag.events if k == "warm_copy_deferred"]
    assert [(f["key"], f["cancelled"]) for f in deferred] == [("k1", True), ("k2", False)], ag.events


def test_with_yield_to_hosts_only_an_operation_on_the_copys_hosts_cancels_it() -> None:
    ag = _Agents({"a": {"k"}, "b": set(), "c": set()}, busy=set(), begin="c", honours_cancel=False)
    wc, _clock = ag.copies(scope="hosts", hosts={"a": "h1", "b": "h2", "c": "h3"})
    ag.stop.set()  # the fetch goes on at once: the operation on c (another host) must not cancel it
    wc.update()
    assert ag.fetched == [("b", "a", "k")] and ag.cancels == [], ag.events
    assert ag.kinds() == ["warm_image_copied"], ag.events
    ag2 = _Agents({"a": {"k"}, "b": set()}, busy=set(), begin="b")
    wc2, _clock = ag2.copies(scope="hosts", hosts={"a": "h1", "b": "h2"})
    wc2.update()
    assert ag2.cancels == [("b", "k")] and ag2.kinds() == ["warm_copy_deferred"], ag2.events


def test_an_operation_whose_node_is_not_chosen_yet_cancels_a_copy_anywhere() -> None:
    ag = _Agents({"a": {"k"}, "b": set()}, busy=set(), begin=ANY_NODE)
    wc, _clock = ag.copies(scope="hosts", hosts={"a": "h1", "b": "h2"})
    wc.update()
    assert ag.cancels == [("b", "k")] and ag.kinds() == ["warm_copy_deferred"], ag.events


def test_a_cancel_the_agent_ignores_is_not_waited_for_forever(monkeypatch) -> None:
    import relocator.controller.warmcopies as WCM

    monkeypatch.setattr(WCM, "CANCEL_WAIT_S", 0.05)
    ag = _Agents({"a": {"k"}, "b": set()}, busy=set(), honours_cancel=False)
    ag.stop = threading.Event()  # cancel sets it, but the fetch below never looks again
    ag.fetch_done = threading.Event()

    returned: list[bool] = []

    def stubborn(dst: str, src: str, key: str) -> dict:
        ag.fetched.append((dst, src, key))
        ag.busy.add("a")
        ag.fetch_done.wait(60)
        returned.append(True)
        return {"copied": True}

    ag.fetch = stubborn  # type: ignore[method-assign]
    wc, _clock = ag.copies()
    wc.update()  # returns after CANCEL_WAIT_S, the copy still blocked
    assert returned == [] and ag.cancels and ag.kinds() == ["warm_copy_deferred"], ag.events
    assert not wc._running.is_set()
    ag.fetch_done.set()


def test_busy_nodes_names_the_nodes_of_every_operation_and_reads_nothing_when_idle() -> None:
    from types import SimpleNamespace

    from relocator.controller.claims import Claims

    class NoStore:
        def __getattr__(self, name):
            raise AssertionError(f"the store was read ({name}) with nothing under way")

    claims = Claims()
    assert busy_nodes(claims, NoStore()) == set()
    workers = {"w1": SimpleNamespace(node="n1"), "w2": SimpleNamespace(node="n2")}
    rels = [SimpleNamespace(src="n1", dst="n3"), SimpleNamespace(src="n4", dst=None)]
    store = SimpleNamespace(worker=workers.get, open_relocations=lambda: rels)
    claims.busy |= {"w1"}
    claims.placing |= {"w2"}  # a resume or launch claimed on n2
    assert busy_nodes(claims, store) == {"n1", "n2", "n3", "n4", ANY_NODE}  # n4's move: target not chosen
    rels.clear()
    assert busy_nodes(claims, store) == {"n1", "n2"}
    claims.placing.add("d9")  # a demand being seated: no record, its node not chosen
    assert ANY_NODE in busy_nodes(claims, store)


def test_copy_outcomes_are_counted_in_the_store_for_metrics() -> None:
    from relocator.controller.store import Store

    store = Store(":memory:")
    count = stored_counter(store)
    for outcome in ("copied", "deferred", "deferred"):
        count(outcome)
    assert {r["outcome"]: r["n"] for r in store.all(COUNTS)} == {"copied": 1, "deferred": 2}


def test_the_agent_stops_a_copy_ahead_of_need_on_cancel_and_drops_its_partial_image(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from relocator.agent import warmcopy as A
    from relocator.warm.store import ImageStore

    store = ImageStore(tmp_path / "s", 10_000)
    key = "vllm-0.1-" + "a" * 32
    started, end = threading.Event(), threading.Event()

    class Ops(A.WarmCopyOps):
        node = "b"
        warm = SimpleNamespace(store=lambda cfg: store)

    def receive(self, store, src, key, chunk_bytes, background, stop):  # the real one pulls from Ray
        staged = store.staging(key)

        def chunks():
            started.set()
            while not end.is_set():
                yield ("pages-1.img", 0, b"x", None)
                time.sleep(0.005)

        try:
            for name, _off, data, _d in A.until_cancelled(chunks(), stop, f"warm image {key}"):
                with open(staged / name, "ab") as fh:
                    fh.write(data)
        except BaseException:
            store.discard(staged)
            raise

    monkeypatch.setattr(Ops, "_receive", receive)
    ops, box = Ops(), {}

    def run(background: bool) -> None:
        try:
            box["got"] = ops.fetch_warm("a", key, background=background)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            box["got"] = exc

    t = threading.Thread(target=run, args=(True,))
    t.start()
    assert started.wait(60)
    assert ops.cancel_warm_copy(key) is True
    t.join(60)
    assert isinstance(box["got"], A.CopyCancelled), box
    assert list((store.root / "tmp").iterdir()) == [] and store.list() == []  # nothing partial left
    assert ops.cancel_warm_copy(key) is False  # none runs now
    # an on-demand copy (a start waits for it) is not the controller's to cancel
    started.clear()
    t = threading.Thread(target=run, args=(False,))
    t.start()
    assert started.wait(60)
    assert ops.cancel_warm_copy(key) is False
    t.join(0.2)
    alive = t.is_alive()
    end.set()
    t.join(60)
    assert alive, box  # it went on copying after the cancel


def test_the_copy_outcomes_are_a_prometheus_counter() -> None:
    from relocator.controller.metrics import ControllerCollector
    from relocator.controller.store import Store

    store = Store(":memory:")
    stored_counter(store)("deferred")
    (fam,) = ControllerCollector.warm_metrics(store)
    samples = {(s.name, s.labels["outcome"]): s.value for s in fam.samples}
    assert samples == {("relocator_warm_copies_total", "deferred"): 1}, samples


def test_a_lost_worker_whose_only_holder_is_lost_goes_where_the_planner_says() -> None:
    from types import SimpleNamespace

    from relocator.controller.workers import WorkerManager

    free = {"b": 2, "c": 2}

    def place(gpus: int, exclude: tuple[str, ...] = ()) -> str | None:
        fits = [n for n in sorted(free) if free[n] >= gpus and n not in exclude]
        return fits[0] if fits else None

    # the last round saw the image only on the lost node: no live holder, so no preference
    mgr = SimpleNamespace(place=place, kinds={"w": "k"},
                          image_holders=lambda key: ({"lost"}, {"lost", "b", "c"}))
    assert WorkerManager._place_near_image(mgr, SimpleNamespace(id="w", gpus=1, node="lost")) == "b"
