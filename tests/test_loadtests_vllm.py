"""The token check against a real vLLM CPU worker (tiny random-weight Llama, greedy): the
reference is run directly against the worker, the load through the router with a switch in
the middle (to the same worker: every in-flight stream is continued from its token ids)."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtests import LoadConfig, check_tokens, make_reference, run_load
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.server import RouterServer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]


async def test_token_check_real_vllm_through_switch(vllm_server, tiny_model_dir, tmp_path):
    w = vllm_server
    srv = await RouterServer(RouterSettings(port=0, control_port=0, hold_timeout_s=30, backends=[
        BackendConfig(model=w.model, url=w.base_url, worker_id="w0",
                      tokenizer=str(tiny_model_dir))])).start()
    try:
        cfg = LoadConfig(url=srv.url, model=w.model, concurrency=4, requests=24,
                         prompt_words=[4, 16], output_tokens=[48, 96], distinct=6, seed=2,
                         greedy_fraction=0.8)
        ref = await make_reference(cfg, url=w.base_url)
        assert ref and all(len(v) in (48, 96) for v in ref.values())
        task = asyncio.create_task(run_load(cfg))
        moved = 0
        phases = []
        async with RouterControl(srv.control_url) as rc:
            for _ in range(3):
                await asyncio.sleep(0.3)
                for _ in range(200):  # switch only while streams are in flight
                    if task.done() or srv.table.get("w0").in_flight:
                        break
                    await asyncio.sleep(0.01)
                if task.done():
                    break
                a = time.time()
                await rc.hold("w0")
                moved += (await rc.switch("w0", w.base_url))["moved_streams"]
                phases.append(("switch", a, time.time()))
        rep = await asyncio.wait_for(task, 240)
        tc = check_tokens(rep, ref)
        s = rep.summary()
        assert s["failed_requests"] == 0, s["errors"]
        assert moved >= 1
        assert (tc.tokens_lost, tc.tokens_duplicated, tc.tokens_mismatched) == (0, 0, 0)
        assert tc.texts_checked >= 8 and tc.text_mismatched == 0, tc.text_bad
        assert tc.checked >= 8 and tc.ok, tc.bad
        rep.write_png(tmp_path / "t.png", phases=phases)
    finally:
        await srv.stop()
