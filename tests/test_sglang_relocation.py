"""An SGLang worker in a cell on the local Ray cluster, moved live under streaming load:
CRIU dump, restore on another node, router switch, every stream continued on SGLang with the
SGLang codec; ids and text checked against a run without a move (issue 11). Next to the vLLM
worker of the same session, under its own model name: a mixed fleet behind one router."""

from __future__ import annotations

import pytest

from adapters.sglang.adapter import installed
from tests.helpers import clean, why_not_done

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not installed(), reason="SGLang is not installed here "
                                 "(.venv-sglang: bash scripts/install-sglang.sh)")]


def test_sglang_worker_moves_under_load(relocator_cluster, tiny_model_dir) -> None:
    from relocator.cluster.scenario import relocate_under_load

    ctl = relocator_cluster
    # a model directory, not "tiny-llama": its own name in the router, apart from vLLM workers
    w = ctl.launch(str(tiny_model_dir), gpus=1, engine="sglang")
    try:
        assert w["engine"] == "sglang" and w["state"] == "running", w
        for attempt in (1, 2):
            res = relocate_under_load(ctl, w["id"], None, w["model"], concurrency=4, max_tokens=128)
            rel, load = res["relocation"], res["load"]
            clean(load)  # whatever the move's outcome, no client may see it: a rollback loses nothing
            assert all(c["verified"] == c["requests"] for c in load["clients"])
            if rel["result"] == "done":
                break
            # CI once saw a rolled-back move here with a full suite beside it (cause not kept:
            # pytest cut the record); a rollback is the safe outcome, so one more try, with why
            print(f"sglang move attempt {attempt}: {why_not_done(rel)}")
            assert rel["result"] == "rolled_back" and attempt == 1, why_not_done(rel)
        moved = next(x for x in ctl.status()["workers"] if x["id"] == w["id"])
        assert moved["node"] != w["node"] and moved["state"] == "running"
        print("sglang relocation", rel["phases"], "blackout", load["blackout_max_s"],
              "image", rel.get("image_bytes"))
        # a failed restore rolls back: the stopped source resumes and serves, nothing lost
        res = relocate_under_load(ctl, w["id"], None, w["model"], concurrency=4, max_tokens=128,
                                  faults={"restore": True}, warmup_s=1.0)
        rel, load = res["relocation"], res["load"]
        assert rel["result"] == "rolled_back" and rel["error"].startswith("RESTORE"), why_not_done(rel)
        clean(load)
        after = next(x for x in ctl.status()["workers"] if x["id"] == w["id"])
        assert (after["node"], after["cell"], after["state"]) == (moved["node"], moved["cell"], "running")
        # make-before-break (issue 29), asked for by name: a second SGLang copy, warmed up from the
        # router's streams (SGLang's radix cache keeps their KV), takes the streams and the source
        # is never frozen. Its continuations are NOT checked token by token: on this CPU build they
        # were not exact (24 tokens, 3 texts of 81 requests, 2026-12-04: the target's KV comes from
        # prefill, the source's from decoding), so `auto` never picks a handoff for SGLang
        # (relocator.controller.transfers.handoff.INEXACT_ENGINES, tests/test_handoff.py)
        res = relocate_under_load(ctl, w["id"], None, w["model"], concurrency=4, max_tokens=128,
                                  transfer="handoff", stagger=True)
        rel, load = res["relocation"], res["load"]
        assert rel["result"] == "done", why_not_done(rel)
        assert load["requests"] > 0 and load["client_errors"] == 0, load["errors"]
        print("sglang handoff exactness: tokens lost/dup/mismatched", load["tokens_lost"], load["tokens_duplicated"],
              load["tokens_mismatched"], "texts", load["text_mismatched"], "of", load["requests"], "requests")
        full = ctl.get_relocation(rel["id"])
        restore = next(p["info"] for p in full["phases"] if p["name"] == "RESTORE")
        assert restore["source_frozen_s"] == 0.0 and restore["warmup_rounds"] >= 1, restore
        assert restore["recomputed_tokens"] > 0, restore
        handed = next(x for x in ctl.status()["workers"] if x["id"] == w["id"])
        assert handed["node"] != after["node"] and handed["state"] == "running", handed
        print("sglang handoff", rel["phases"], "blackout", load["blackout_max_s"], "start", restore.get("start_s"),
              "warm", restore.get("warm"))
    finally:
        ctl.stop_worker(w["id"])
