"""Real CRIU dumps and restores of a real vLLM CPU worker in a cell."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from relocator.cell.cell import Cell, list_cells
from relocator.snapshot import (
    Image,
    ImageError,
    IncompatibleImage,
    RestoreTarget,
    dump,
    resume_source,
    restore,
)
from relocator.snapshot.snapshot import expected_fingerprint
from relocator.worker import wait_ready

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the cluster node", "a worker moves to a new", "red river mountain light and"]


async def _greedy(endpoint: str, prompt: str, max_tokens: int = 24) -> list[int]:
    async with aiohttp.ClientSession() as s:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        async with s.post(f"{endpoint}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["token_ids"]


def greedy_all(endpoint: str) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return [await _greedy(endpoint, p) for p in PROMPTS]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference(worker_cell: Cell) -> list[list[int]]:
    return greedy_all(worker_cell.endpoint)


@pytest.fixture(scope="module")
def image(worker_cell: Cell, reference, tmp_path_factory: pytest.TempPathFactory):
    """One dump of the serving worker; the source is left stopped until the module's end."""
    img = dump(worker_cell, tmp_path_factory.mktemp("img") / "image")
    assert worker_cell.is_stopped()
    yield img
    if worker_cell.is_stopped():
        resume_source(worker_cell)


def test_restore_while_stopped_source_exists_gives_identical_output(worker_cell: Cell, reference, image: Image) -> None:
    assert worker_cell.is_alive() and worker_cell.is_stopped()  # the original PIDs still exist
    cell = restore(image)
    try:
        asyncio.run(wait_ready(cell, timeout=60))
        assert cell.endpoint != worker_cell.endpoint
        assert greedy_all(cell.endpoint) == reference
        assert cell.origin == f"restore:{image.path}"
        # dump() hashed these very files moments ago: no second full hash on the hot path
        assert json.loads((cell.dir / "restore_timings.json").read_text())["verified_by"] == "stamp"
    finally:
        cell.kill()
    assert worker_cell.is_stopped()  # untouched by the restore


def test_image_manifest(image: Image, worker_cell: Cell) -> None:
    m = image.manifest
    assert m.cell.source_cell == worker_cell.id and m.cell.port == worker_cell.port
    assert m.fingerprint.engine.engine == "vllm" and m.fingerprint.engine.model_id == "tiny-llama"
    assert m.timings["criu_dump_s"] > 0
    assert any(name.startswith("pages-") for name in m.files)
    assert image.bytes == sum((image.path / n).stat().st_size for n in m.files)


def test_flipped_byte_is_refused_and_source_resumes(worker_cell: Cell, reference, image: Image) -> None:
    pages = max((p for p in image.path.glob("pages-*.img")), key=lambda p: p.stat().st_size)
    offset = pages.stat().st_size // 2
    with open(pages, "r+b") as fh:
        fh.seek(offset)
        original = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([original[0] ^ 0xFF]))
    try:
        before = {c.id for c in list_cells()}
        with pytest.raises(ImageError, match=f"{pages.name} is corrupt"):
            restore(image)
        assert {c.id for c in list_cells()} == before  # nothing was started
        # the CLI says the same, with a non-zero exit and no traceback
        proc = subprocess.run([sys.executable, "-m", "relocator", "snapshot", "restore", str(image.path)],
                              capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 3 and "corrupt" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        with open(pages, "r+b") as fh:
            fh.seek(offset)
            fh.write(original)
    # the source resumes and serves exactly as before; then it is dumped again for later tests
    resume_source(worker_cell)
    assert greedy_all(worker_cell.endpoint) == reference


def test_tampered_manifest_is_refused(image: Image) -> None:
    path = image.path / "manifest.json"
    text = path.read_text()
    data = json.loads(text)
    data["cell"]["port"] = 9999
    path.write_text(json.dumps(data))
    try:
        with pytest.raises(ImageError, match="digest does not match"):
            restore(image.path)
    finally:
        path.write_text(text)


def test_fingerprint_mismatch_is_refused_with_reason(image: Image) -> None:
    target = expected_fingerprint(image.manifest)
    target.engine.weight_sha256 = "0" * 64
    target.host.cpu_model = "Some Other CPU"
    with pytest.raises(IncompatibleImage) as info:
        restore(image, RestoreTarget(fingerprint=target, verify="none"))
    fields = {m.field: m for m in info.value.mismatches}
    assert set(fields) == {"engine.weight_sha256", "host.cpu_model"}
    assert fields["host.cpu_model"].found == "Some Other CPU"
    assert fields["engine.weight_sha256"].expected == image.manifest.fingerprint.engine.weight_sha256


def test_cli_inspect_json(image: Image) -> None:
    proc = subprocess.run([sys.executable, "-m", "relocator", "snapshot", "inspect", str(image.path), "--json"],
                          capture_output=True, text=True, cwd=REPO, check=True)
    info = json.loads(proc.stdout)
    assert info["bytes"] == image.bytes and info["compatible_here"] is True
    assert info["manifest"]["fingerprint"]["host"]["criu_version"].startswith("4.")


def test_dump_again_after_resume(worker_cell: Cell, reference, tmp_path: Path) -> None:
    """A resumed source can be dumped again (CRIU's leftover links are cleaned on resume)."""
    if worker_cell.is_stopped():
        resume_source(worker_cell)
    img = dump(worker_cell, tmp_path / "again")
    try:
        assert img.bytes > 0 and worker_cell.is_stopped()
    finally:
        resume_source(worker_cell)
    assert greedy_all(worker_cell.endpoint) == reference
