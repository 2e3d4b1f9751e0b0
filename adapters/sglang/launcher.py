"""Start SGLang's HTTP server so that CRIU can dump and restore the whole process tree.

Run with .venv-sglang's interpreter as `python -m adapters.sglang.launcher <sglang server args>`
(repository root and adapters/sglang/stub_sgl_kernel on PYTHONPATH; the adapter's command does
that). What it changes, and why:
- the stdlib asyncio loop replaces uvloop everywhere SGLang asks for it (the tokenizer
  manager's and HTTP server's `asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())` at
  import, uvicorn's `loop="uvloop"`): libuv opens an io_uring instance even with
  UV_USE_IO_URING=0, and CRIU cannot dump io_uring;
- SGLANG_USE_CPU_ENGINE=1 (else loading the model imports vLLM's CUDA ops) and the stand-in
  `sgl_kernel` on sys.path (no CPU build of the real one exists on PyPI).
SGLang starts its scheduler and detokenizer with multiprocessing's *spawn*: each child
re-imports this module as its main module, so the patches apply there too. The tree is one
process group under the launcher: HTTP server + tokenizer manager (this process), scheduler,
detokenizer.
"""

from __future__ import annotations

import asyncio
import os
import sys

os.environ.setdefault("UV_USE_IO_URING", "0")
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


_use_stdlib_asyncio()


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
