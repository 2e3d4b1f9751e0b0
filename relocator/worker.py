"""Launch an engine worker in a cell and wait for it: glue between adapters and cells."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from adapters.base import DEFAULT_ENGINE, LaunchSpec, get_adapter
from relocator import waits
from relocator.cell.cell import Cell, CellError, launch_cell


def spec_to_dict(spec: LaunchSpec) -> dict:
    data = dataclasses.asdict(spec)
    data["model_dir"] = str(spec.model_dir)
    return data


def spec_from_dict(data: dict) -> LaunchSpec:
    """The inverse of spec_to_dict (a cell's or an image's launch record)."""
    return LaunchSpec(**{**data, "model_dir": Path(data["model_dir"])})


def launch_worker(spec: LaunchSpec, engine: str = DEFAULT_ENGINE, cell_id: str | None = None,
                  gpu_ids: list[int] | None = None) -> Cell:
    """Start a worker cell; returns at once (the engine is still loading).

    `gpu_ids`: host GPU indices passed through to the cell (relocator.cell.devices); kept out of
    the LaunchSpec, which travels in images: a restored worker gets the target's GPUs."""
    spec.host = "0.0.0.0"  # inside the cell's own network namespace
    adapter = get_adapter(engine)
    argv, env = adapter.command(spec)
    return launch_cell(argv, env, spec.port, engine=engine, launch=spec_to_dict(spec), cell_id=cell_id,
                       gpu_ids=gpu_ids)


async def wait_ready(cell: Cell, timeout: float = 300.0, poll: float = 0.25) -> float:
    """Wait until the cell's engine serves; returns the seconds waited."""
    adapter = get_adapter(cell.engine)
    start = time.monotonic()

    async def serving() -> bool:
        if not cell.is_alive():
            raise CellError(f"cell {cell.id} died while starting:\n{cell.log_tail()}")
        return await adapter.is_ready(cell.endpoint, timeout=2.0)

    try:
        await waits.until_async(serving, timeout, every=poll, what=f"cell {cell.id}'s engine")
    except waits.WaitTimeout:
        raise CellError(f"cell {cell.id} not ready after {timeout:.0f}s:\n{cell.log_tail()}") from None
    return time.monotonic() - start


#: a worker's context length instead of LaunchSpec's default, read where workers are launched
#: (the agents): `relocator bench relocation --prompt-tokens` sets it for its own cluster
ENV_MAX_MODEL_LEN = "RELOCATOR_MAX_MODEL_LEN"


def max_model_len_from_env() -> int:
    """The context length a worker launched here gets: ENV_MAX_MODEL_LEN, else LaunchSpec's."""
    raw = os.environ.get(ENV_MAX_MODEL_LEN, "").strip()
    if not raw:
        return LaunchSpec.max_model_len
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV_MAX_MODEL_LEN}={raw!r}: a context length in tokens (a positive integer)")
    return value


def default_spec(model_dir: Path, name: str = "tiny-llama", port: int | None = None,
                 engine: str = DEFAULT_ENGINE) -> LaunchSpec:
    from relocator.tinymodel import cache_root

    return LaunchSpec(model_dir=model_dir, served_model_name=name, max_model_len=max_model_len_from_env(),
                      port=port or get_adapter(engine).default_port, cache_dir=str(cache_root()))
