"""scripts/gpu-check.sh and its parts: the reference engine's device extras (KV pool, CUDA
graph), the token comparison, the script's argument errors, and (integration) the whole
`--device cpu` run: three moves under 8 streams through the router, each exact."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from adapters.reference.device import DeviceExtras
from relocator.bench.gpucheck import PROMPTS, compare

ROOT = Path(__file__).resolve().parents[1]


def test_compare_counts_lost_dup_mismatched_and_errors():
    base = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    got = [[1, 2, 9, 4], [5, 6, 7, 7], RuntimeError("boom")]
    assert compare(base, got) == {"tokens_lost": 2, "tokens_dup": 1, "tokens_mismatched": 1,
                                  "client_errors": 1}
    assert compare(base, [list(b) for b in base]) == {"tokens_lost": 0, "tokens_dup": 0,
                                                       "tokens_mismatched": 0, "client_errors": 0}
    assert compare([[1, 2, 3]], [[1, 2]])["tokens_lost"] == 1


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
    assert out["moves"]["handoff"]["source_frozen_s"] == 0.0
    assert out["cuda_checkpoint_GBps"] is None and out["cuda_graph_ok"] is None
