"""Start vLLM's OpenAI server so that CRIU can dump and restore the whole process tree.

Run as `python -m adapters.vllm.launcher <vllm serve args>`. What it changes, and why:
- the stdlib asyncio loop replaces uvloop: libuv opens an io_uring instance (even with
  UV_USE_IO_URING=0) and CRIU cannot dump io_uring;
- the KV-cache pool is allocated without being written (torch.empty instead of torch.zeros),
  so pool pages no request ever used stay untouched and are not in the image. vLLM writes a
  slot before any attention kernel reads it, so the initial content never matters.
- inductor's precompiled headers (~150 MB, written at every start) go to the inductor cache on
  host storage instead of the temp dir: in the cell's tmpfs they would be tarred into every
  image and rebuilt at every cold start.
The patches sit at module level: vLLM spawns its engine processes, which re-import this
module as their main module, so they are patched too.
"""

from __future__ import annotations

import asyncio
import os
import types

os.environ.setdefault("UV_USE_IO_URING", "0")


def _use_stdlib_asyncio() -> None:
    import uvloop

    def run(main, *, debug=None, **_kwargs):  # uvloop.run's signature
        return asyncio.run(main, debug=debug)

    uvloop.run = run
    uvloop.install = lambda: None
    uvloop.new_event_loop = asyncio.new_event_loop
    uvloop.EventLoopPolicy = asyncio.DefaultEventLoopPolicy


def _lazy_kv_pool() -> None:
    import torch
    import vllm.v1.worker.utils as worker_utils

    class _TorchWithLazyZeros(types.ModuleType):
        """The torch module, except that a 1-D int8 zeros() (the KV pool) is left unwritten."""

        def __getattr__(self, name: str):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, dtype=None, device=None, **kwargs):
            if dtype is torch.int8 and len(size) == 1 and isinstance(size[0], int):
                dev = torch.device(device) if device is not None else torch.device("cpu")
                if dev.type == "cpu":
                    return torch.empty(size[0], dtype=dtype, device=dev, **kwargs)
            return torch.zeros(*size, dtype=dtype, device=device, **kwargs)

    if os.environ.get("RELOCATOR_LAZY_KV_POOL", "1") == "1":
        worker_utils.torch = _TorchWithLazyZeros("torch")


def _shared_header_dir() -> None:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache:
        import torch._inductor.codecache as codecache

        codecache._HEADER_DIR = os.path.join(cache, "precompiled_headers")


_use_stdlib_asyncio()
_lazy_kv_pool()
_shared_header_dir()


def main() -> None:
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
