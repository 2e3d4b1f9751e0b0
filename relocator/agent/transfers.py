"""The node agent's side of the transfer modes (NodeAgent inherits `TransferOps`).

- stream: `open_page_server` on the target (relocator.agent.pagestream), `dump(page_server=)`
  on the source, then `receive_image` on the target completes the image;
- postcopy: `dump_lazy` on the source (the tree stays frozen, its memory served on demand),
  the image's small files streamed, `restore(page_source=)` on the target
  (relocator.agent.postcopy), `postcopy_wait` there, `lazy_dump_wait` on the source;
- auto: `transfer_info` (what this node's kernel and CRIU allow) and the image-store probe
  (`store_token` here, `sees` on the peer).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def transfer_address() -> str:
    """Where this node's page servers listen and its peers connect: RELOCATOR_TRANSFER_ADDRESS,
    else Ray's address of this node (127.0.0.1 on the local cluster, a host's own address on
    emulated or real hosts), else loopback."""
    addr = os.environ.get("RELOCATOR_TRANSFER_ADDRESS")
    if addr:
        return addr
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


class TransferOps:
    """The node agent's transfer calls (NodeAgent inherits them)."""

    images_dir: Path
    _receivers: dict[str, Any]
    _lazy_dumps: dict[str, Any]

    def _lock(self, cell_id: str) -> threading.Lock:  # NodeAgent's per-cell lock
        raise NotImplementedError

    def transfer_info(self) -> dict[str, Any]:
        """What this node can do for each transfer mode (`transfer: auto`, preflight)."""
        from relocator.snapshot import criu

        uffd = criu.feature("uffd-noncoop")
        pipes = criu.lazy_dump_pipes()
        dirty = criu.feature("mem_dirty_track")
        return {"address": transfer_address(), "images_dir": str(self.images_dir),
                "uffd_noncoop": list(uffd), "lazy_dump_pipes": list(pipes), "mem_dirty_track": list(dirty),
                "postcopy": uffd[0] and pipes[0]}

    def store_token(self) -> dict[str, str]:
        """Write a token file into this node's image store; a peer that reads it back sees the
        same store (shared storage)."""
        import uuid

        token = uuid.uuid4().hex
        path = self.images_dir / f".store-probe-{token}"
        path.write_text(token)
        return {"path": str(path), "token": token}

    def sees(self, path: str, token: str) -> bool:
        try:
            return Path(path).read_text() == token
        except OSError:
            return False

    def drop_token(self, path: str) -> None:
        p = Path(path)
        if p.name.startswith(".store-probe-"):
            p.unlink(missing_ok=True)

    def open_page_server(self, image_dir: str) -> dict[str, Any]:
        """`transfer: stream`: a page server receiving a dump's memory into `image_dir` (this
        node's), hashed as it arrives; receive_image completes the image."""
        from relocator.agent.pagestream import PageReceiver

        old = self._receivers.pop(str(image_dir), None)
        if old is not None:
            old.abort()
        rx = PageReceiver(Path(image_dir), transfer_address()).start()
        self._receivers[str(image_dir)] = rx
        return {"address": rx.address, "port": rx.port, "image_dir": str(image_dir)}

    def dump_lazy(self, cell_id: str, image_dir: str) -> dict[str, Any]:
        """`transfer: postcopy`, source side: dump all but the memory, keep the tree frozen and
        serve its memory on a page server until a lazy restore has it all (lazy_dump_wait)."""
        from relocator.agent.postcopy import LazySource
        from relocator.cell.cell import load_cell
        from relocator.snapshot import dump_lazy
        from relocator.snapshot.images import lazy_bytes

        with self._lock(cell_id):
            t0 = time.monotonic()
            cell = load_cell(cell_id)
            address = transfer_address()
            img, proc, port = dump_lazy(cell, Path(image_dir), address)
            from relocator.agent.postcopy import _raise_priority

            _raise_priority(proc.pid)  # its page server answers the target's page faults
            LazySource(cell.dir).record(proc.pid, address, port, str(image_dir))
            self._lazy_dumps[cell_id] = proc
            pump_port, pump_error = 0, ""
            if os.environ.get("RELOCATOR_POSTCOPY_PUSH", "1") != "0":
                from relocator.agent import pump
                from relocator.snapshot.criu import CriuError

                try:  # the memory's bulk on a channel of its own (relocator.agent.pump)
                    _, pump_port = pump.start(cell.dir, Path(image_dir), cell.init_pid, proc.pid, address)
                except (CriuError, OSError, KeyError, ValueError) as exc:  # on demand only, then
                    pump_error = str(exc)[:500]
            try:
                lazy = lazy_bytes(Path(image_dir))
            except Exception:  # noqa: BLE001 - a figure only
                lazy = 0
            return {"image_dir": str(img.path), "bytes": img.bytes, "lazy_bytes": lazy, "address": address,
                    "port": port, "pump_port": pump_port, "pump_error": pump_error,
                    "seconds": round(time.monotonic() - t0, 3), "timings": img.manifest.timings,
                    "pages": img.manifest.pages.value}

    def lazy_dump_wait(self, cell_id: str, timeout: float = 1.0) -> dict[str, Any]:
        """Whether the cell's lazy dump has ended (its page server served everything): {done,
        rc}. Waits at most `timeout` (the controller polls, checking the nodes meanwhile)."""
        from relocator.agent.postcopy import LazySource
        from relocator.cell.cell import cells_dir

        src = LazySource(cells_dir() / cell_id)
        proc = self._lazy_dumps.get(cell_id)
        if src.info() is None and proc is None:
            return {"done": True, "rc": None, "unknown": True}
        out = src.wait(timeout, proc)
        if out["done"]:
            self._lazy_dumps.pop(cell_id, None)
            src.clear()
        return out

    @staticmethod
    def _postcopy_state(cell_dir: Path) -> dict[str, Any]:
        from relocator.agent.postcopy import read_state

        return read_state(cell_dir) or {"state": "absent"}

    def postcopy_status(self, cell_id: str) -> dict[str, Any]:
        """The post-copy of a restored copy: state (ready, running, done, failed), page bytes
        arrived, why it failed (target, source, stall, daemon)."""
        from relocator.cell.cell import cells_dir

        return self._postcopy_state(cells_dir() / cell_id)

    def postcopy_wait(self, cell_id: str, timeout: float = 1.0) -> dict[str, Any]:
        """The post-copy's state once it is done or failed, or after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.postcopy_status(cell_id)
            if st.get("state") in ("done", "failed", "absent") or time.monotonic() >= deadline:
                return st
            time.sleep(0.02)
