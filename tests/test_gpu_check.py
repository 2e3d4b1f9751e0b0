"""scripts/gpu-check.sh and its parts: the reference engine's device extras (KV pool, CUDA
graph), the token comparison, the script's argument errors, and (integration) the whole
`--device cpu` run: three moves under 8 streams through the router, each exact (the third a
handoff to a copy restored from a warm capture)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from adapters.reference.device import DeviceExtras
from relocator.bench.gpucheck import PROMPTS, compare, handoff_ok, summary, warmup_plan

ROOT = Path(__file__).resolve().parents[1]


def test_compare_counts_lost_dup_mismatched_and_errors():
    base = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    got = [[1, 2, 9, 4], [5, 6, 7, 7], RuntimeError("boom")]
    assert compare(base, got) == {"tokens_lost": 2, "tokens_dup": 1, "tokens_mismatched": 1,
                                  "client_errors": 1}
    assert compare(base, [list(b) for b in base]) == {"tokens_lost": 0, "tokens_dup": 0,
                                                       "tokens_mismatched": 0, "client_errors": 0}
    assert compare([[1, 2, 3]], [[1, 2]])["tokens_lost"] == 1


def _handoff(**over):
    m = {"tokens_lost": 0, "tokens_dup": 0, "tokens_mismatched": 0, "client_errors": 0, "left_on_source": 0,
         "source_frozen_s": 0.0, "source_never_stopped": True, "warm": True, "blackout_s": 0.01,
         "start_s": 0.5, "max_token_gap_s": 0.1, "switch": {"moved_streams": 8}}
    return {**m, **over}


@pytest.mark.parametrize("over, warm_asked, ok", [
    ({}, True, True),
    ({"warm": False}, False, True),  # GPU_CHECK_WARM=0: a cold target is the plan
    ({"warm": False}, True, False),  # a warm start was asked for and did not happen
    ({"tokens_mismatched": 1}, True, False),
    ({"client_errors": 1}, True, False),
    ({"left_on_source": 2}, True, False),
    ({"source_never_stopped": False}, True, False),
    ({"source_frozen_s": 0.4}, True, False),
    ({"switch": {"moved_streams": 0}}, True, True),  # reported, not required (a matter of speed)
])
def test_handoff_ok(over, warm_asked, ok):
    m = _handoff(**over)
    assert handoff_ok(m, warm_asked) is ok, m
    assert handoff_ok({}, warm_asked) is False  # the move never ran


def test_summary_names_the_handoff_and_needs_it_for_ok():
    move = {"tokens_lost": 0, "tokens_dup": 0, "tokens_mismatched": 0, "client_errors": 0,
            "source_stayed_stopped": True, "blackout_s": 1.0}
    R = {"device": "cpu", "warm_capture_asked": True, "warm_capture": {"ok": True, "image_bytes": 1},
         "moves": {"pool_in_image": dict(move), "pool_left_out": dict(move), "handoff": _handoff()}}
    summary(R)
    assert R["ok"] is True and R["handoff_ok"] is True, R
    assert (R["handoff_warm"], R["handoff_moved_streams"], R["handoff_source_frozen_s"],
            R["handoff_blackout_s"], R["handoff_start_s"]) == (True, 8, 0.0, 0.01, 0.5), R
    R["moves"]["handoff"]["source_never_stopped"] = False
    summary(R)
    assert R["ok"] is False and R["handoff_ok"] is False, R


def test_warmup_plan_rounds_only_where_a_prefix_cache_keeps_them():
    from relocator.controller.transfers.handoff import CATCH_UP_ROUNDS, MAX_ROUNDS

    assert warmup_plan(True)["rounds"] == MAX_ROUNDS and warmup_plan(True)["catch_up_rounds"] == CATCH_UP_ROUNDS
    plain = warmup_plan(False)  # the reference engine: one round (its calls run), no catch-up
    assert plain["rounds"] == 1 and plain["catch_up_rounds"] == 0 and "prefix cache" in plain["why"]


def test_kv_pool_is_released_and_reserved_on_cpu():
    x = DeviceExtras(torch.device("cpu"), torch.ones(4, 4), pool_mb=2)
    assert x.pool_bytes() == 2 << 20 and float(x.pool.min()) == 1.0  # every page written
    assert x.release() == 2 << 20 and x.pool_bytes() == 0
    assert x.check() == {"pool_bytes": 0, "graph": None, "device_bytes": None}
    assert x.reserve() == 2 << 20


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError, match="--device cuda"):
        DeviceExtras(torch.device("cpu"), torch.ones(4, 4), graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
def test_cuda_graph_replays_the_eager_result():
    w = torch.randn(64, 32, device="cuda")
    x = DeviceExtras(torch.device("cuda"), w, pool_mb=1, graph=True)
    got = x.check()
    assert got["graph"] is True and got["pool_bytes"] == 1 << 20 and got["device_bytes"] > 0


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "--device must be auto, cuda or cpu"),
    (["--tokens", "3"], "--tokens must be a number >= 8"),
    (["--bundle", "/nonexistent"], "is not a bundle"),
    (["--frobnicate"], "unknown argument"),
    (["--tokens"], "needs a value"),
])
def test_gpu_check_rejects_bad_arguments(args, message):
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh"), *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_gpu_bundle_rejects_bad_arguments(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu-bundle.sh"), str(tmp_path / "b"),
                        "--cuda-checkpoint", str(tmp_path / "missing")], capture_output=True, text=True)
    assert r.returncode == 2 and "is not an executable file" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu-bundle.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.integration
def test_gpu_check_cpu_moves_three_times_exactly():
    """Two freeze-and-copy moves, a warm capture, and a handoff to the warm copy (one run)."""
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh"), "--device", "cpu", "--json",
                        "--tokens", "128", "--kv-pool-mb", "64"],
                       capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout)  # stdout is the JSON alone
    assert r.returncode == 0, (out.get("error"), out.get("moves"), r.stderr[-2000:])
    assert out["ok"] and out["device"] == "cpu" and out["streams"] == len(PROMPTS) == 8
    assert set(out["moves"]) == {"pool_in_image", "pool_left_out", "handoff"}
    for k in ("tokens_lost", "tokens_dup", "tokens_mismatched", "client_errors"):
        assert out[k] == 0, k
    assert out["source_stayed_stopped"] is True
    # streams were in flight when the source froze: the router continued them on the copy
    assert out["moves"]["pool_in_image"]["switch"]["moved_streams"] > 0
    assert out["moves"]["pool_left_out"]["switch"]["moved_streams"] > 0
    # the free pool (64 MiB, every page written) is in the first image and not in the second
    assert out["image_bytes"] - out["image_bytes_no_kv_pool"] > 50 << 20
    assert out["moves"]["pool_left_out"]["pool_reserved_bytes"] == 64 << 20
    h = out["moves"]["handoff"]
    assert h["source_frozen_s"] == 0.0 and h["source_never_stopped"] is True, h
    # the handoff's target is the copy restored from the warm capture's image
    assert out["warm_capture"]["ok"] is True, out["warm_capture"]
    assert out["handoff_ok"] is True and out["handoff_warm"] is True, h
    assert h["left_on_source"] == 0 and h["warmup"]["warmup_rounds"] <= 1, h
    assert out["cuda_checkpoint_GBps"] is None and out["cuda_graph_ok"] is None
