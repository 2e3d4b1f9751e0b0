"""`relocator bench gateway`, small: every side measured, the move through LiteLLM with the
plugin and through the router clean, through LiteLLM alone not (what users have today)."""

from __future__ import annotations

import json

import pytest

from relocator.gateways.litellm_proxy import available

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_bench_gateway_small():
    if available():
        pytest.skip(available())
    from relocator.bench.gateway import run

    res = await run(duration_s=1.0, rounds=1, move_tokens=60, move_concurrency=4)
    sides = ("litellm", "litellm_plugin", "router") + (("envoy_epp",) if "c1" in res.get(
        "envoy_epp", {}) else ())
    for side in sides:
        for c in ("c1", "c64"):  # no counts asserted: a busy machine may finish none in 1 s
            assert res[side][c]["errors"] == 0, (side, c, res)
            assert {"ttfb_p50_ms", "ttfb_p99_ms", "req_per_s"} <= set(res[side][c])
    for side in sides[1:]:
        m = res[side]["move"]
        assert m["client_errors"] == 0 and m["tokens_lost"] == 0, (side, m)
        assert m["tokens_mismatched_or_duplicated"] == 0, (side, m)
    assert res["litellm"]["move"]["client_errors"] > 0  # streams cut by the move, not continued
    assert res["targets"]["plugin_move_clean"]
    json.dumps(res, allow_nan=False)  # strict JSON
