"""`transfer: handoff` on the state machine with a fake backend: the source is never held,
dumped or resumed; the target copy is warmed up in rounds from the router's streams; any
failure before SWITCH only removes the target copy."""

from __future__ import annotations

import pytest

from relocator.controller.machine import DONE, ROLLED_BACK, Machine
from relocator.controller.model import Relocation, WorkerRecord
from relocator.controller.store import Store
from relocator.controller.transfers import AUTO_ORDER, STRATEGIES
from relocator.controller.transfers.handoff import CATCH_UP_ROUNDS, GAP_TOKENS, SOURCE_NICE, TARGET_NICE, WarmUp
from relocator.vocab import TransferMode
from tests.test_controller_machine import FakeBackend


class HandoffBackend(FakeBackend):
    """The fake plus the handoff's calls: a router whose one stream runs ahead by `step`
    tokens at every listing, and a target that records what it prefilled."""

    def __init__(self, step: int = 30) -> None:
        super().__init__()
        self.sent: list[int] = []
        self.step = step
        self.prefilled: list[list[int]] = []
        self.stay_on_source = 0  # streams the router kept on the source at SWITCH
        self.catch_ups: list[int] = []  # the router's catch-up rounds asked at each switch call
        self.nice: list[tuple[str, str, int | None]] = []  # the copies' priorities, as asked
        self.started_at: list[int | None] = []  # each target copy's nice at its start
        self.at_token: list[bool] = []  # each switch call: cut at the streams' next token?
        self.reach: list = []  # the router's answers to its reach probes, in turn (then: reachable)

    def prioritize(self, node, cell, nice):
        self._call("prioritize", node, cell)
        self.nice.append((node, cell, nice))
        return 3

    def start_copy(self, node, cell, worker, gpu_ids, nice=None):
        self._call("start_copy", node, cell)
        self.started_at.append(nice)
        self.cells[(node, cell)] = "running"
        return {"endpoint": f"http://{node}/{cell}", "cell_id": cell, "warm": {"how": "warm", "key": "k"}}

    def router_streams(self, wid):
        self._call("router_streams", wid)
        if self.step:
            self.sent.extend(range(len(self.sent), len(self.sent) + self.step))
            self.step //= 3  # the target catches up: each round is shorter
        now = self.router[wid]["endpoint"]  # exact streams follow the switch, kept ones stay
        on = [{"prompt_ids": [1, 2, 3], "sent_ids": list(self.sent), "endpoint": now, "inexact": []}]
        return on + [{"prompt_ids": [5], "sent_ids": [], "endpoint": "http://a", "inexact": ["seed"]}] \
            * self.stay_on_source

    def router_reaches(self, wid, timeout_s=2.0):
        self._call("router_reaches", wid)
        got = self.reach.pop(0) if self.reach else True
        if isinstance(got, Exception):
            raise got
        return {"reachable": got, "endpoint": self.router[wid]["endpoint"], "seconds": 0.01}

    def prefill(self, node, endpoint, model, sequences):
        self._call("prefill", node, endpoint)
        self.prefilled.extend(sequences)
        return {"sequences": len(sequences)}

    def handoff_switch(self, wid, endpoint, keep_inexact=True, cut_from=None, catch_up_rounds=0, at_token=False):
        self.catch_ups.append(catch_up_rounds)
        self.at_token.append(at_token)
        info = self.switch(wid, endpoint)
        if not keep_inexact:
            assert cut_from == "http://a"  # only the source's streams are cut past the window
            self.stay_on_source = 0
        return info


@pytest.fixture
def env(tmp_path):
    store = Store(tmp_path / "c.db")
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=2, cell_id="c1", endpoint="http://a",
                                   state="running", reservation="pg-w1", model_dir="/models/m"))
    return store, HandoffBackend()


def _run(store, be, **kw) -> Relocation:
    return Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="handoff", **kw))


def test_auto_tries_a_handoff_first() -> None:
    assert TransferMode.HANDOFF in STRATEGIES
    assert AUTO_ORDER[0].mode is TransferMode.HANDOFF  # taken only where the target starts warm
    assert not STRATEGIES[TransferMode.HANDOFF].freezes_source


class AutoBackend(HandoffBackend):
    """The handoff fake whose controller says whether the target would start warm (`warm`:
    {warm, why} as relocator.controller.warmwhere answers, or an exception), and whether the
    nodes share an image store (auto's next choice)."""

    def __init__(self, warm) -> None:
        super().__init__()
        self.warm = warm

    def warm_image(self, worker, node):
        self._call("warm_image", worker.id, node)
        if isinstance(self.warm, Exception):
            raise self.warm
        return self.warm

    def shared_storage(self, src, dst):
        return True


@pytest.mark.parametrize("warm", [
    {"warm": "here", "why": "n2 holds a warm image of its kind (k1)"},
    {"warm": "near", "from": "n3", "why": "n3, on n2's host, holds a warm image of its kind (k1): copied at the start"},
])
def test_auto_picks_a_handoff_where_the_target_starts_warm(env, warm) -> None:
    store, _ = env
    be = AutoBackend(warm)
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="auto"))
    assert (rel.result, rel.transfer) == (DONE, TransferMode.HANDOFF), (rel.result, rel.transfer, rel.error)
    plan = rel.phases[0]["info"]
    assert plan["requested"] == "auto" and plan["transfer"] == "handoff", plan
    assert plan["why"].startswith("handoff (make-before-break): " + warm["why"]), plan
    assert rel.summary()["transfer_why"] == plan["why"]  # status and `relocator relocate` show it
    names = [c[0] for c in be.calls]
    assert "hold" not in names and "dump" not in names and ("warm_image", "w1", "n2") in be.calls


@pytest.mark.parametrize("warm, why", [
    ({"warm": "", "why": "no warm image of its kind (k1) on n2 or its host"},
     "no handoff: no warm image of its kind (k1) on n2 or its host"),
    (TimeoutError("agent of n2: warm_keys did not answer"),
     "no handoff: where warm images are is not known (TimeoutError: agent of n2: warm_keys did not answer)"),
])
def test_auto_keeps_the_freezing_choice_where_the_target_would_start_cold(env, warm, why) -> None:
    store, _ = env
    be = AutoBackend(warm)
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="auto"))
    assert (rel.result, rel.transfer) == (DONE, TransferMode.SHARED), (rel.result, rel.transfer, rel.error)
    assert rel.summary()["transfer_why"] == f"{why}; n2 sees n1's image store", rel.summary()
    assert "start_copy" not in [c[0] for c in be.calls]


def test_auto_never_hands_off_an_engine_whose_continuation_from_a_prefilled_copy_is_inexact(tmp_path) -> None:
    store = Store(tmp_path / "c.db")
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=1, cell_id="c1", endpoint="http://a",
                                   state="running", reservation="pg-w1", model_dir="/models/m", engine="sglang"))
    be = AutoBackend({"warm": "here", "why": "n2 holds a warm image of its kind (k1)"})
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="auto"))
    assert (rel.result, rel.transfer) == (DONE, TransferMode.SHARED), (rel.result, rel.transfer, rel.error)
    assert rel.summary()["transfer_why"].startswith("no handoff for sglang: SGLang's continuation"), rel.summary()
    assert "start_copy" not in [c[0] for c in be.calls] and "warm_image" not in [c[0] for c in be.calls]


def test_auto_never_hands_off_a_worker_without_a_launch_record(tmp_path) -> None:
    store = Store(tmp_path / "c.db")
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=2, cell_id="c1", endpoint="http://a",
                                   state="running", reservation="pg-w1"))  # no model_dir: nothing to start
    be = AutoBackend({"warm": "here", "why": "n2 holds a warm image of its kind (k1)"})
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="auto"))
    assert rel.transfer == TransferMode.SHARED and "no handoff: no launch record" in rel.summary()["transfer_why"]
    assert "warm_image" not in [c[0] for c in be.calls]


def test_handoff_moves_without_freezing_the_source(env) -> None:
    store, be = env
    rel = _run(store, be)
    assert rel.result == DONE, rel.error
    names = [c[0] for c in be.calls]
    assert "hold" not in names and "dump" not in names and "resume" not in names and "restore" not in names
    order = [n for n in names if n in ("reserve", "start_copy", "prefill", "switch", "kill", "free")]
    assert order[:2] == ["reserve", "start_copy"] and order[-3:] == ["switch", "kill", "free"]
    assert be.live() == [("n2", "w1-r1")]
    assert be.router["w1"]["endpoint"] == "http://n2/w1-r1"
    info = rel.phases[[p["name"] for p in rel.phases].index("RESTORE")]["info"]
    assert info["source_frozen_s"] == 0.0 and info["warm"] is True
    assert info["warmup_rounds"] >= 2  # the source ran ahead while the first round prefilled
    # the last prefill is within a few tokens of what the source had sent
    assert len([1, 2, 3] + be.sent) - len(be.prefilled[-1]) <= GAP_TOKENS
    assert info["prefix_hit_tokens"] > 0 and info["recomputed_tokens"] == len(be.prefilled[-1])
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state) == ("n2", "w1-r1", "running")
    assert be.catch_ups == [CATCH_UP_ROUNDS] and CATCH_UP_ROUNDS > 0  # the router's last rounds
    assert be.at_token == [True]  # each stream cut right after its next token (the source serves until then)
    # the source favoured while the target starts; the target started low, normal before it
    # warms up and serves, and again at RELEASE (never left low)
    assert be.started_at == [TARGET_NICE] and TARGET_NICE > 0
    # None: normal, the agent's own nice (what every copy it starts has)
    # the source from RESERVE on (before the target's GPUs are held), and again at RESTORE
    assert be.nice == [("n1", "c1", SOURCE_NICE)] * 2 + [("n2", "w1-r1", None), ("n2", "w1-r1", None)] \
        and SOURCE_NICE < 0, be.nice
    first = next(i for i, c in enumerate(be.calls) if c[0] == "prioritize")
    assert first < names.index("reserve"), be.calls
    prio = [i for i, c in enumerate(be.calls) if c[0] == "prioritize" and c[1] == "n2"]
    assert prio[0] < names.index("prefill") and prio[-1] > names.index("switch"), be.calls
    assert info["target_normal_priority"] is True and rel.phases[-1]["info"]["target_normal_priority"] is True


@pytest.mark.parametrize("failing", ["start_copy", "prefill", "router_streams"])
def test_a_failure_before_the_switch_removes_only_the_target_copy(env, failing) -> None:
    store, be = env
    be.fail[failing] = RuntimeError(f"{failing} broke")
    rel = _run(store, be)
    assert rel.result == ROLLED_BACK
    names = [c[0] for c in be.calls]
    assert "switch" not in names and "resume" not in names and "hold" not in names and "release" not in names
    assert be.live() == [("n1", "c1")]  # the source served throughout; no target copy left
    assert be.router["w1"] == {"endpoint": "http://a", "held": False}
    assert be.nice[-1] == ("n1", "c1", None)  # its priority as before (normal)
    assert "relocator-w1-r1" not in be.reserved
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state) == ("n1", "c1", "running")


def test_a_switch_that_fails_sets_the_sources_priority_back(env) -> None:
    store, be = env
    be.fail["switch"] = RuntimeError("router unreachable")
    rel = _run(store, be)
    assert rel.result == ROLLED_BACK, rel.error
    assert be.nice[0] == ("n1", "c1", SOURCE_NICE) and be.nice[-1] == ("n1", "c1", None), be.nice
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state) == ("n1", "c1", "running")


def test_streams_kept_on_the_source_are_continued_past_the_window(env) -> None:
    store, be = env
    be.stay_on_source = 1
    m = Machine(store, be, handoff_window_s=0.0)  # config controller.handoff_window_s
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="handoff"))
    assert rel.result == DONE, rel.error
    info = rel.phases[-1]["info"]
    assert info["continued_past_window"] == 2  # the fake's switch says 2 moved
    assert be.catch_ups == [CATCH_UP_ROUNDS, 0]  # past the window: cut at once, no catch-up
    assert be.stay_on_source == 0 and be.live() == [("n2", "w1-r1")]


def test_warm_up_bookkeeping_counts_hits_and_recomputed_tokens() -> None:
    w = WarmUp()
    s = {"prompt_ids": [1, 2], "sent_ids": [3, 4, 5, 6, 7, 8]}
    assert w.due([s]) == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert (w.prefix_hit_tokens, w.recomputed_tokens) == (0, 8)
    s["sent_ids"] += [9, 10]  # 2 ahead: within the gap
    assert w.due([s], gap=4) == []
    s["sent_ids"] += [11, 12, 13]
    assert w.due([s], gap=4) == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert (w.prefix_hit_tokens, w.recomputed_tokens) == (8, 13)


def test_the_engines_cached_token_count_is_read_when_it_says_it() -> None:
    from relocator.agent.modes.handoff import cached_tokens, prefill_request

    assert cached_tokens(b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}') == 8
    assert cached_tokens(b'{"usage": {"prompt_tokens": 9}}') == 0
    assert cached_tokens(b"not json") == 0
    assert prefill_request("m", [1, 2])[1]["max_tokens"] == 1


def test_a_handoffs_blackout_is_its_switch_only() -> None:
    from relocator.controller.relocations import BLACKOUT_PHASES, blackout_phases

    assert blackout_phases({"transfer": "handoff"}) == ("SWITCH",)
    assert blackout_phases({"transfer": "stream"}) == BLACKOUT_PHASES
    assert blackout_phases({}) == BLACKOUT_PHASES


def test_a_target_whose_priority_cannot_be_set_back_still_moves_and_it_is_retried(env) -> None:
    store, be = env
    real = be.prioritize
    failures = {"n": 0}

    def prioritize(node, cell, nice):
        if node == "n2" and failures["n"] < 2:  # RESTORE's two tries fail; RELEASE's works
            failures["n"] += 1
            raise RuntimeError("agent busy")
        return real(node, cell, nice)

    be.prioritize = prioritize
    rel = _run(store, be)
    assert rel.result == DONE, rel.error  # a priority is logged, never fatal
    restore = rel.phases[[p["name"] for p in rel.phases].index("RESTORE")]["info"]
    assert restore["target_normal_priority"] is False, restore
    assert rel.phases[-1]["info"]["target_normal_priority"] is True, rel.phases[-1]
    assert be.nice[-1] == ("n2", "w1-r1", None), be.nice  # the serving copy at normal priority


@pytest.mark.parametrize("when", ["switch", "window"])
def test_a_target_lost_after_the_switch_rolls_back_to_the_serving_source(env, when) -> None:
    """CI's chaos smoke (handoff-kill-target-switch): the target copy died after the router
    switched to it and the move came out done, the live source killed at RELEASE and the
    worker lost. The source never stopped: the move goes back to it."""
    store, be = env
    real_switch = be.handoff_switch

    def switch_then_die(wid, endpoint, **kw):
        info = real_switch(wid, endpoint, **kw)
        if when == "window" and not kw.get("keep_inexact", True):
            be.cells[("n2", "w1-r1")] = "absent"  # dies as the kept streams are cut past the window
        return info

    real_state = be.cell_state
    checks = {"n": 0}

    def cell_state(node, cell):
        if node == "n2" and when == "switch":
            checks["n"] += 1
            if checks["n"] > 2:  # alive for SWITCH's two checks, dead at RELEASE's
                be.cells[(node, cell)] = "absent"
        return real_state(node, cell)

    be.handoff_switch, be.cell_state = switch_then_die, cell_state
    if when == "window":
        be.stay_on_source = 1
    rel = Machine(store, be, handoff_window_s=0.0).run(
        Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="handoff"))
    assert rel.result == ROLLED_BACK, (rel.result, rel.error)
    assert rel.rollback["from_phase"] == "RELEASE" and "w1-r1 on n2 is absent" in rel.error, rel.summary()
    if when == "window":  # found by the last check, right before the source would stop
        assert "before the source is stopped" in rel.error, rel.error
    assert rel.reason == "target_lost", rel.reason
    assert be.live() == [("n1", "c1")], be.cells  # the source was never killed
    assert be.router["w1"]["endpoint"] == "http://a", be.router  # the router back at the source
    assert be.nice[-1] == ("n1", "c1", None), be.nice  # and the source at its own priority again
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.endpoint, w.state) == ("n1", "c1", "http://a", "running"), w


def test_a_target_lost_at_the_switch_check_rolls_back_with_the_sources_priority_back(env) -> None:
    store, be = env
    real_switch = be.handoff_switch

    def switch_then_die(wid, endpoint, **kw):
        info = real_switch(wid, endpoint, **kw)
        be.cells[("n2", "w1-r1")] = "absent"  # dead by SWITCH's check after the router call
        return info

    be.handoff_switch = switch_then_die
    rel = _run(store, be)
    assert rel.result == ROLLED_BACK and rel.rollback["from_phase"] == "SWITCH", rel.summary()
    assert be.live() == [("n1", "c1")] and be.router["w1"]["endpoint"] == "http://a", (be.cells, be.router)
    assert be.nice[-1] == ("n1", "c1", None), be.nice


def test_a_target_the_router_cannot_reach_rolls_back_before_the_source_stops(env) -> None:
    """A network cut between the router and the target at the switch: the copy is alive to its
    agent, but stopping the source would leave the worker unreachable (chaos fault
    handoff-network-cut-switch)."""
    store, be = env
    be.reach = [False, False, False]
    rel = _run(store, be)
    assert rel.result == ROLLED_BACK and rel.rollback["from_phase"] == "RELEASE", rel.summary()
    assert "router cannot reach target copy w1-r1" in rel.error and rel.reason == "target_lost", rel.error
    assert [c for c in be.calls if c[0] == "router_reaches"] == [("router_reaches", "w1")] * 3
    assert be.live() == [("n1", "c1")] and be.router["w1"]["endpoint"] == "http://a", (be.cells, be.router)


@pytest.mark.parametrize("answers", [[False, True], [RuntimeError("404: no such path (an older router)")]])
def test_a_router_that_reaches_the_target_late_or_cannot_say_lets_the_move_finish(env, answers) -> None:
    store, be = env
    be.reach = list(answers)
    rel = _run(store, be)
    assert rel.result == DONE, (rel.result, rel.error)
    assert be.live() == [("n2", "w1-r1")] and be.router["w1"]["endpoint"] == "http://n2/w1-r1", be.router
