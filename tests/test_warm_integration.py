"""A real warm image: CRIU leave-running capture of a real vLLM CPU worker into a store, and
two warm starts from it on one node at once (issue 28)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relocator.cell.cell import Cell
from relocator.warm.capture import capture, key_of_cell
from relocator.warm.start import key_for_launch, restore_warm
from relocator.warm.store import ImageStore
from relocator.worker import spec_from_dict, wait_ready
from tests.test_snapshot_integration import greedy_all

pytestmark = pytest.mark.integration


def test_capture_leaves_the_worker_serving_and_two_restores_coexist(worker_cell: Cell, tmp_path: Path) -> None:
    import asyncio

    reference = greedy_all(worker_cell.endpoint)
    store = ImageStore(tmp_path / "warm", max_bytes=8 << 30)
    entry, dumped = capture(worker_cell, store)
    assert dumped and entry.key == key_of_cell(worker_cell)
    assert entry.key == key_for_launch(spec_from_dict(worker_cell.launch), worker_cell.engine)
    assert worker_cell.is_alive() and not worker_cell.is_stopped()  # leave-running
    assert greedy_all(worker_cell.endpoint) == reference  # and it serves on as before
    assert capture(worker_cell, store)[1] is False  # one image per kind
    copies: list[Cell] = []
    try:
        for _ in range(2):  # two restores of one image on one node: own cells, namespaces, ports
            copies.append(restore_warm(store, entry.key))
        for cell in copies:
            asyncio.run(wait_ready(cell, timeout=120))
        assert copies[0].id != copies[1].id and copies[0].netns != copies[1].netns
        assert [greedy_all(c.endpoint) for c in copies] == [reference, reference]
    finally:
        for cell in copies:
            cell.kill()
    assert [e.key for e in store.list()] == [entry.key]  # still there for the next start
