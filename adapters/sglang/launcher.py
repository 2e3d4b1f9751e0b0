"""Start SGLang's HTTP server so that CRIU can dump and restore the whole process tree.

Run with .venv-sglang's interpreter as `python -m adapters.sglang.launcher <sglang server args>`
(repository root and adapters/sglang/stub_sgl_kernel on PYTHONPATH; the adapter's command does
that). What it changes, and why:
- the stdlib asyncio loop replaces uvloop everywhere SGLang asks for it (the tokenizer
  manager's and HTTP server's `asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())` at
  import, uvicorn's `loop="uvloop"`): libuv opens an io_uring instance even with
  UV_USE_IO_URING=0, and CRIU cannot dump io_uring;
- torch.distributed's TCPStore without libuv (USE_LIBUV=0): SGLang's scheduler initialises a
  one-rank gloo group, and the store's libuv loop opens an io_uring instance too;
- after a restore: the process CPU clock continues instead of restarting at zero (SGLang's
  scheduler crashed on a negative counter increment), and signals to a psutil.Process kept
  from before the dump are delivered (psutil took the restored parent for a reused PID);
- greedy requests that share a batch with sampled ones (temperature > 0) take the argmax of
  their logits, as in an all-greedy batch (SGLang sorts those rows' probabilities instead,
  and ties then fall by batch composition: a continued stream could differ from the run it
  continues);
- on cpu (RELOCATOR_SGLANG_DEVICE, the adapter sets it): SGLANG_USE_CPU_ENGINE=1 (else loading
  the model imports vLLM's CUDA ops) and the stand-in `sgl_kernel` on sys.path (no CPU build of
  the real one exists on PyPI); on cuda neither.
SGLang starts its scheduler and detokenizer with multiprocessing's *spawn*: each child
re-imports this module as its main module, so the patches apply there too. The tree is one
process group under the launcher: HTTP server + tokenizer manager (this process), scheduler,
detokenizer.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("UV_USE_IO_URING", "0")
# The scheduler sets up torch.distributed (gloo) even with one rank; its TCPStore's default
# libuv backend (thread "pt_tcpstore_uv", libuv bundled in libtorch) opens an io_uring
# instance as well. USE_LIBUV=0 selects the store's plain-socket backend.
os.environ.setdefault("USE_LIBUV", "0")
if os.environ.get("RELOCATOR_SGLANG_DEVICE", "cpu") == "cpu":
    # CUDA's SGLang (requirements-sglang-cuda.lock) has the real kernels and engine
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    _STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_sgl_kernel")
    if _STUB not in sys.path:
        sys.path.insert(0, _STUB)


def _use_stdlib_asyncio() -> None:
    import uvloop

    def run(main, *, debug=None, **_kwargs):  # uvloop.run's signature
        return asyncio.run(main, debug=debug)

    uvloop.run = run
    uvloop.install = lambda: None
    uvloop.new_event_loop = asyncio.new_event_loop
    uvloop.EventLoopPolicy = asyncio.DefaultEventLoopPolicy


def _restorable_clocks() -> None:
    """A process CPU clock that never goes backward across a restore.

    CRIU cannot restore a process's consumed CPU time: after a restore, time.process_time_ns()
    starts again from (nearly) zero. SGLang's scheduler increments a Prometheus counter by the
    difference of two readings (sglang:scheduler_process_cpu_seconds_total), which then is
    negative, raises ValueError and kills the scheduler. The reading is offset so that it
    continues from the last value seen before the dump.
    """
    import threading
    import time

    raw = time.process_time_ns
    lock = threading.Lock()
    state = {"last": 0, "offset": 0}

    def process_time_ns() -> int:
        now = raw()
        with lock:
            if now + state["offset"] < state["last"]:
                state["offset"] = state["last"] - now
            state["last"] = now + state["offset"]
            return state["last"]

    time.process_time_ns = process_time_ns
    time.process_time = lambda: process_time_ns() / 1e9


def _psutil_signals_after_restore() -> None:
    """Signals to a psutil.Process taken before a dump still arrive after the restore.

    psutil guards against PID reuse by comparing a process's start time; a restored process
    has a new one, so SGLang's children, which keep `psutil.Process().parent()` to send it
    SIGQUIT when they fail, would get NoSuchProcess instead and the tree would not shut down.
    Inside the cell's own PID namespace the PID is the same process: send it with os.kill.
    """
    import psutil

    send = psutil.Process.send_signal

    def send_signal(self, sig):
        try:
            return send(self, sig)
        except psutil.NoSuchProcess:
            os.kill(self.pid, sig)

    psutil.Process.send_signal = send_signal


def _greedy_rows_take_argmax(sampler) -> None:
    """Greedy output that does not depend on what else is in the batch.

    An all-greedy batch takes torch.argmax of the logits (the first of tied maxima). A batch
    that also holds sampled requests goes through softmax and a top-k sort instead, where
    greedy rows are top_k=1 rows: tied probabilities (common with low-precision logits) come
    out of the unstable sort in an order that depends on the batch, so the same greedy request
    gave different tokens alone and next to a sampled one (seen: 7 of 38 greedy requests in a
    mixed load). Token-exact continuation relies on greedy being a function of the sequence
    alone, so those rows are set to the argmax of the logits the sampler was given.
    """
    import torch

    forward = sampler.Sampler.forward

    def patched(self, logits_output, sampling_info, *args, **kwargs):
        if sampling_info.is_all_greedy or sampling_info.has_custom_logit_processor:
            return forward(self, logits_output, sampling_info, *args, **kwargs)
        greedy = sampling_info.top_ks <= 1
        if not bool(greedy.any()):
            return forward(self, logits_output, sampling_info, *args, **kwargs)
        # before the sampler scales and softmaxes the logits in place
        argmax = torch.argmax(logits_output.next_token_logits, -1)
        ids = forward(self, logits_output, sampling_info, *args, **kwargs)
        ids[greedy] = argmax[greedy].to(ids.dtype)
        return ids

    sampler.Sampler.forward = patched


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Apply `patch(module)` right after `name` is first imported, in whichever process does
    (only the scheduler imports the sampler; importing it everywhere would cost each process
    ~0.1 GB and seconds)."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


_use_stdlib_asyncio()
_restorable_clocks()
_psutil_signals_after_restore()
sys.meta_path.insert(0, _PatchOnImport("sglang.srt.layers.sampler", _greedy_rows_take_argmax))


def main(argv: list[str] | None = None) -> None:
    # What `sglang serve` / `python -m sglang.launch_server` do, from this module.
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
