"""vLLM adapter pieces that need no server: command line, continuation body, metrics, KV pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.base import LaunchSpec, get_adapter, get_codec

REPO = Path(__file__).resolve().parents[1]


def test_command_is_criu_friendly(tmp_path: Path) -> None:
    argv, env = get_adapter("vllm").command(LaunchSpec(model_dir=tmp_path, served_model_name="m", port=9000))
    assert argv[1:3] == ["-m", "adapters.vllm.launcher"]  # asyncio instead of uvloop, lazy KV pool
    assert argv[argv.index("--port") + 1] == "9000"
    assert "--enable-prompt-tokens-details" in argv and "--enable-prefix-caching" in argv
    assert env["HF_HUB_OFFLINE"] == "1"


def test_continuation_request_is_the_codecs() -> None:
    """One continuation, the router's: the adapter hands out its codec."""
    codec = get_adapter("vllm").codec()
    assert type(codec) is type(get_codec("vllm"))
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "temperature": 0, "stream": True,
            "stop": ["x"], "n": 1}
    path, out = codec.continuation_request("completions", body, [1, 2, 3], [7, 8])
    assert path == "/v1/completions" and out["prompt"] == [1, 2, 3, 7, 8]
    assert out["max_tokens"] == 8
    assert out["stop"] == ["x"] and out["temperature"] == 0 and out["return_token_ids"] is True
    assert codec.unsupported_reason("completions", {**body, "n": 2}) is not None


def test_env_and_cache_dir(tmp_path: Path) -> None:
    spec = LaunchSpec(model_dir=tmp_path, served_model_name="m", port=9000,
                      cache_dir=str(tmp_path / "c"))
    _, env = get_adapter("vllm").command(spec)
    assert env["VLLM_RPC_BASE_PATH"] == "/run"  # ZMQ sockets on the cell's own tmpfs
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "torchinductor")


def test_adapters_do_not_import_relocator_core() -> None:
    """adapters/ depends on nothing of relocator's but its small helpers (no cycle)."""
    code = ("import sys, adapters.vllm.adapter, adapters.vllm.codec;"
            "bad = [m for m in sys.modules if m.startswith('relocator.') and m not in "
            "('relocator.choices',)];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_parse_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        "# HELP vllm:prompt_tokens_total Prompt\n# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0\n'
        "# HELP python_gc_objects_collected_total gc\n# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 5.0\n'
    )
    m = get_adapter("vllm").parse_metrics(text)
    assert m == {"vllm:num_requests_running": 3.0, "vllm:prompt_tokens_total": 120.0}


def test_unknown_engine_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="unknown engine 'nope'"):
        get_adapter("nope")


_PROBE = """
import json, os, sys
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
lazy = sys.argv[1] == 'lazy'
if lazy:
    import adapters.vllm.launcher  # noqa: F401  (patches vllm.v1.worker.utils.torch)
import vllm.v1.worker.utils as u
import torch
before = rss()
buf = u.torch.zeros(256 * 2**20, dtype=torch.int8, device=torch.device('cpu'))
print(json.dumps({'grew': rss() - before, 'numel': buf.numel()}))
"""


@pytest.mark.skipif(not (REPO / ".venv").exists() and "vllm" not in sys.modules, reason="needs vllm installed")
def test_kv_pool_is_not_touched_at_allocation() -> None:
    """The launcher's KV pool allocation leaves pages untouched, so they never reach an image."""
    pytest.importorskip("vllm")

    def probe(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, cwd=REPO, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    lazy, eager = probe("lazy"), probe("eager")
    assert lazy["numel"] == eager["numel"] == 256 * 2**20
    assert eager["grew"] > 200 * 2**20  # torch.zeros writes every page
    assert lazy["grew"] < 16 * 2**20
