"""`transfer: postcopy`, agent side: what this node's kernel and CRIU allow (`transfer_info`), the
source's lazy dump (the tree stays frozen, its memory served on demand and pushed), and the
target's post-copy state (`restore(page_source=)` starts it: relocator.agent.postcopy)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from relocator.agent.modes.base import ModeBase, transfer_address
from relocator.waits import settle

#: the post-copy states after which nothing changes any more
ENDED = ("done", "failed", "absent")


class PostcopyOps(ModeBase):
    def transfer_info(self) -> dict[str, Any]:
        """What this node can do for each transfer mode (`transfer: auto`, preflight)."""
        from relocator.snapshot import criu
        from relocator.snapshot.fingerprint import gpu_info

        uffd = criu.feature("uffd-noncoop")
        pipes = criu.lazy_dump_pipes()
        dirty = criu.feature("mem_dirty_track")
        return {"address": transfer_address(), "images_dir": str(self.images_dir),
                "uffd_noncoop": list(uffd), "lazy_dump_pipes": list(pipes), "mem_dirty_track": list(dirty),
                "postcopy": uffd[0] and pipes[0],
                # real NVIDIA GPUs (NVML; Ray's fake counts are not): `auto` never picks post-copy here
                "nvidia_gpus": gpu_info().count}

    def dump_lazy(self, cell_id: str, image_dir: str, peer_address: str = "") -> dict[str, Any]:
        """`transfer: postcopy`, source side: dump all but the memory, keep the tree frozen and
        serve its memory on a page server until a lazy restore has it all (lazy_dump_wait).
        `peer_address`: the target's transfer address (its keeper connects from there; "": any)."""
        from relocator.agent.postcopy import LazySource
        from relocator.cell.cell import load_cell
        from relocator.snapshot import dump_lazy
        from relocator.snapshot.images import lazy_bytes

        from relocator import credentials

        with self._lock(cell_id):
            t0 = time.monotonic()
            cell = load_cell(cell_id)
            address = transfer_address()
            # this move's own credentials: the target's keeper gets the peer's end (the offer)
            move = credentials.make_move() if credentials.tls_files() is not None else None
            tls_dir = ""
            try:
                if move is None:  # the by-hand opt-out only: CRIU's page server on the port
                    img, proc, port = dump_lazy(cell, Path(image_dir), address)
                    front_pid = 0
                else:
                    img, proc, port, front_pid, tls_dir = self._lazy_behind_front(cell, Path(image_dir), address, move,
                                                                                  peer_address)
                from relocator.agent.postcopy import _raise_priority

                _raise_priority(proc.pid)  # its page server answers the target's page faults
                LazySource(cell.dir).record(proc.pid, address, port, str(image_dir), front_pid=front_pid)
                self._lazy_dumps[cell_id] = proc
                pump_port, pump_error = 0, ""
                from relocator.agent import locallink

                pump_unix = locallink.new_path() if locallink.enabled() else ""  # for a keeper of this host
                if os.environ.get("RELOCATOR_POSTCOPY_PUSH", "1") != "0":
                    from relocator.agent import pump
                    from relocator.snapshot.criu import CriuError

                    try:  # the memory's bulk on a channel of its own (relocator.agent.pump)
                        _, pump_port = pump.start(cell.dir, Path(image_dir), cell.init_pid, proc.pid, address,
                                                  unix=pump_unix, tls_dir=tls_dir, peer_address=peer_address)
                    except (CriuError, OSError, KeyError, ValueError) as exc:  # on demand only, then
                        pump_error = str(exc)[:500]
            finally:  # the front and the pump loaded them as they started: off the disk now
                credentials.remove_move(tls_dir)
            try:
                lazy = lazy_bytes(Path(image_dir))
            except Exception:  # noqa: BLE001 - a figure only
                lazy = 0
            return {"image_dir": str(img.path), "bytes": img.bytes, "lazy_bytes": lazy, "address": address,
                    "port": port, "pump_port": pump_port, "pump_error": pump_error,
                    "pump_unix": pump_unix if pump_port else "", "host": locallink.identity(),
                    "seconds": round(time.monotonic() - t0, 3), "timings": img.manifest.timings,
                    "pages": img.manifest.pages.value, **({"credential": move["peer"]} if move else {})}

    @staticmethod
    def _lazy_behind_front(cell: Any, image_dir: Path, address: str, move: dict, peer_address: str = "") -> tuple:
        """The lazy dump on one end of a socket pair, the TLS front (a process of its own,
        relocator.agent.front) on the other and on the port: only this move's keeper gets
        through, a stranger's connection holds nothing up. (image, dump, port, front pid, the
        move's credentials directory)."""
        import socket

        from relocator import credentials
        from relocator.agent import front
        from relocator.snapshot import dump_lazy

        ours, criu_end = socket.socketpair()
        try:
            try:
                img, proc, _ = dump_lazy(cell, image_dir, address, ps_socket=criu_end.fileno())
            finally:
                criu_end.close()  # CRIU has its copy
            tls_dir = str(credentials.install_move(move["listener"]))
            try:
                fp, port = front.start_process(cell.dir, ours, address, tls_dir, move["peer"]["cert"],
                                               peer_address=peer_address)
            except BaseException:
                proc.kill()  # no way in: the dump must not keep the tree frozen
                credentials.remove_move(tls_dir)
                raise
            return img, proc, port, fp.pid, tls_dir
        finally:
            ours.close()  # the front has its copy

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
        last: dict[str, Any] = {}

        def ended() -> bool:
            nonlocal last
            last = self.postcopy_status(cell_id)
            return last.get("state") in ENDED

        settle(ended, timeout, every=0.02)
        return last
