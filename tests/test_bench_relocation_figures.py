"""`relocator bench relocation`'s derived figures: the gap over SWITCH and the blackout over the
load's normal (median) inter-token gap (issue 29's definition). Pure: records made by hand."""

from __future__ import annotations

from relocator.cli.bench_relocation import excess, switch_gap

REL = {"phases": [{"name": "RESTORE", "started": 100.0, "ended": 110.0},
                  {"name": "SWITCH", "started": 110.0, "ended": 110.5},
                  {"name": "RELEASE", "started": 110.5, "ended": 112.0}]}


def test_the_switch_gap_is_the_longest_gap_overlapping_switch() -> None:
    gaps = [[104.0, 105.2],  # 1.2 s, inside RESTORE: not the switch's
            [110.3, 110.7],  # 0.4 s across the cut
            [110.45, 110.6]]
    assert switch_gap(REL, gaps, 0.0) == 0.4
    assert switch_gap(REL, [[4.3, 4.7]], 106.0) == 0.4  # monotonic gaps, wall-clock phases
    assert switch_gap(REL, [[104.0, 105.2]], 0.0) == 0.0
    assert switch_gap({"phases": [{"name": "SWITCH", "started": 1.0}]}, gaps, 0.0) is None  # never ended


def test_the_excess_is_the_blackout_over_the_normal_gap() -> None:
    assert excess(0.526, 0.126) == 0.4
    assert excess(0.1, 0.2) == 0.0 and excess(0.5, None) is None


def test_the_loads_normal_gap_is_the_mean_before_the_move() -> None:
    from relocator.cluster.streams import Load, RequestResult

    ref = {0: RequestResult(0, 0, tokens=[1, 2, 3, 4], text="abcd")}
    lo = Load("http://x", "m", ref, max_tokens=4, concurrency=1)  # type: ignore[arg-type]
    # gaps 0.1, 0.0 (two events read at once), 0.5 before the move (window from 10.0), 0.9 across it
    lo.results = [RequestResult(0, 0, tokens=[1, 2, 3], text="abc", times=[1.0, 1.1, 1.1, 1.6], finish_reason="x"),
                  RequestResult(0, 0, tokens=[4], text="d", times=[9.5, 10.4], finish_reason="x")]
    rep = lo.report(window=(10.0, 11.0))
    assert (rep["normal_gap_mean_s"], rep["normal_gap_max_s"], rep["blackout_max_s"]) == (0.2, 0.5, 0.9), rep
