"""The scheduling layer's pure planning (relocator.controller.scheduling) and its records."""

from __future__ import annotations

import pytest

from relocator.controller.model import Demand, DemandKind, DemandState, WorkerRecord, WorkerState, parse_duration
from relocator.controller.scheduling import NodeView, Seat, consolidate, fits, make_room, preempt


def test_fragmented_cluster_one_move_frees_a_node() -> None:
    # issue 13's new user: one 1-GPU worker on each of two nodes, the third node busy
    nodes = [NodeView("n1", 4, 3), NodeView("n2", 4, 3), NodeView("n3", 4, 0)]
    seats = [Seat("w1", "n1", 1), Seat("w2", "n2", 1)]
    assert fits(nodes, 4) is None
    s = make_room(nodes, seats, 4)
    assert s.how == "make_room" and len(s.moves) == 1
    (m,) = s.moves
    assert m.src == s.node and m.dst != s.node and m.dst != "n3"
    assert make_room(nodes, seats, 4, max_moves=0).node is None


def test_fewest_moves_then_fewest_bytes() -> None:
    nodes = [NodeView("n1", 4, 2), NodeView("n2", 4, 2), NodeView("n3", 4, 3)]
    seats = [Seat("a", "n1", 1, bytes=5 << 30), Seat("b", "n1", 1, bytes=5 << 30), Seat("c", "n2", 2, bytes=1 << 30),
             Seat("d", "n3", 1, bytes=9 << 30)]
    s = make_room(nodes, seats, 4)
    assert [m.worker for m in s.moves] == ["c"] and s.node == "n2"  # one move, the lighter node


def test_busy_or_foreign_gpus_are_never_moved() -> None:
    nodes = [NodeView("n1", 4, 3), NodeView("n2", 4, 3)]
    s = make_room(nodes, [Seat("w1", "n1", 1, movable=False), Seat("w2", "n2", 1, movable=False)], 4)
    assert s.node is None and "not even after" in s.reason
    # n2's 4 used GPUs belong to no worker (another tenant's reservation): w1 has nowhere to go
    assert make_room([NodeView("n1", 4, 3), NodeView("n2", 4, 0)], [Seat("w1", "n1", 1)], 4).node is None
    s = make_room([NodeView("n1", 4, 3), NodeView("n2", 4, 1)], [Seat("w1", "n1", 1)], 4)
    assert [(m.worker, m.dst) for m in s.moves] == [("w1", "n2")]


def test_excluded_node_is_neither_target_nor_destination() -> None:
    nodes = [NodeView("n1", 4, 3), NodeView("n2", 4, 3), NodeView("n3", 4, 4)]
    seats = [Seat("w1", "n1", 1), Seat("w2", "n2", 1)]
    assert make_room(nodes, seats, 4).node == "n3"
    s = make_room(nodes, seats, 4, exclude=("n3",))
    assert s.node in ("n1", "n2") and all(m.dst != "n3" for m in s.moves)


def test_preempt_fewest_lower_priority() -> None:
    nodes = [NodeView("n1", 4, 0), NodeView("n2", 4, 0)]
    seats = [Seat("a", "n1", 4, priority=0), Seat("b", "n2", 2, priority=0), Seat("c", "n2", 2, priority=0)]
    s = preempt(nodes, seats, 4, priority=1)
    assert (s.node, s.suspends, s.how) == ("n1", ["a"], "preempt")
    assert preempt(nodes, seats, 4, priority=0).node is None  # never an equal priority
    seats = [Seat("a", "n1", 4, priority=3), Seat("b", "n2", 2, priority=0), Seat("c", "n2", 2, priority=1)]
    assert preempt(nodes, seats, 4, priority=2).suspends == ["b", "c"]
    assert preempt(nodes, seats, 2, priority=2).suspends == ["b"]  # the lowest priority first


def test_consolidate_frees_nodes() -> None:
    nodes = [NodeView("n1", 4, 2), NodeView("n2", 4, 3), NodeView("n3", 4, 4)]
    out = consolidate(nodes, [Seat("a", "n1", 2), Seat("b", "n2", 1)])
    assert [(m.worker, m.src, m.dst) for m in out["moves"]] == [("b", "n2", "n1")] and out["nodes_freed"] == ["n2"]
    assert consolidate(nodes, [Seat("a", "n1", 2), Seat("b", "n2", 1)], max_moves=0)["moves"] == []


def test_records_and_durations() -> None:
    d = Demand.from_dict(Demand(id="w3", kind="launch", model="m", gpus=4).to_dict())
    assert d.kind is DemandKind.LAUNCH and d.state is DemandState.PENDING
    assert set(d.summary()) >= {"id", "model", "gpus", "priority", "since", "reason"}
    with pytest.raises(ValueError, match="valid: launch, resume"):
        Demand(id="x", kind="evict", model="m", gpus=1)
    w = WorkerRecord.from_dict({"id": "w1", "model": "m", "node": "n1", "gpus": 1, "state": "suspended"})
    assert w.state == WorkerState.SUSPENDED and w.priority == 0 and w.time_limit_s is None
    assert [parse_duration(v) for v in (90, "90s", "15m", "2h", "1d", None)] == [90, 90, 900, 7200, 86400, None]
    for bad in ("3x", "-5", "0", "m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_a_cordoned_node_receives_nothing() -> None:
    """Every planning call keeps off a cordoned node (drain --by): fits, make_room, preempt,
    consolidate; its own workers may still leave."""
    nodes = [NodeView("n1", 4, 4, cordoned=True), NodeView("n2", 4, 3), NodeView("n3", 4, 3)]
    seats = [Seat("w2", "n2", 1), Seat("w3", "n3", 1)]
    assert fits(nodes, 4) is None and fits(nodes, 1) in ("n2", "n3")
    s = make_room(nodes, seats, 4)
    assert s.node in ("n2", "n3") and all(m.dst != "n1" for m in s.moves)
    full = [NodeView("n1", 4, 4, cordoned=True), NodeView("n2", 4, 0)]
    assert preempt(full, [Seat("a", "n2", 4)], 4, priority=1).node == "n2"
    assert preempt([NodeView("n1", 4, 0, cordoned=True)], [Seat("a", "n1", 4)], 4, priority=1).node is None
    spread = [NodeView("n1", 4, 2, cordoned=True), NodeView("n2", 4, 3), NodeView("n3", 4, 4)]
    out = consolidate(spread, [Seat("a", "n1", 2), Seat("b", "n2", 1)])
    assert all(m.dst != "n1" for m in out["moves"]), out  # b would have gone to n1
    assert [(m.worker, m.dst) for m in consolidate([NodeView("n1", 4, 2), *spread[1:]],
                                                   [Seat("a", "n1", 2), Seat("b", "n2", 1)])["moves"]] == [("b", "n1")]
