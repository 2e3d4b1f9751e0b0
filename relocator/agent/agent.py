"""The node agent: one per node, owns that node's cells.

`NodeAgent` is a plain class (tested directly); `start_agent` runs it as a named, detached Ray
actor pinned to its node. Cells are not the agent's children: they are recorded under the
node's state directory, and a restarted agent re-adopts every live one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

from relocator.agent.modes import ModeOps
from relocator.waits import settle
from relocator.warm.launch import WarmStarts

from relocator.agent.names import NAMESPACE, agent_name  # noqa: F401 - re-exported
from relocator.agent.warmcopy import WarmCopyOps, batched_arrays, pulled_chunks


def _report_if_ran(cell: Any) -> None:
    """A GPU source must stay stopped and checkpointed from DUMP until RELEASE (docs/gpu.md):
    say so in the agent's log when one did not (a second live copy of the worker ran)."""
    import logging

    from relocator.snapshot.snapshot import released_source_ran

    ran = released_source_ran(cell)
    if ran:
        logging.getLogger("relocator.agent").error(
            "cell %s: the source ran after its dump (a second live copy): %s", cell.id, "; ".join(ran))


class NodeAgent(ModeOps, WarmCopyOps):  # every transfer mode's ops, warm image copies
    def __init__(self, node: str, state_dir: str, images_dir: str,
                 credentials: dict[str, str] | None = None) -> None:
        # One agent per process: the cell registry follows RELOCATOR_STATE_DIR.
        os.environ["RELOCATOR_STATE_DIR"] = state_dir
        if credentials:  # beside the state dir, 0600; CRIU, keeper and pump find them by env
            from relocator.credentials import install

            install(credentials, Path(state_dir).parent / "credentials")
        self.node = node
        self.state_dir = Path(state_dir)
        self.images_dir = Path(images_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.images_dir.mkdir(parents=True, exist_ok=True)
        from relocator.agent.sweep import sweep

        # unix sockets and move credentials that crashed moves left (only ours, old, unused)
        self.swept = sweep(self.state_dir)
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        # transfers in progress (relocator.agent.pagestream / postcopy): page servers by target
        # image directory, lazy dumps (their CRIU process) by cell
        self._receivers: dict[str, Any] = {}
        self._lazy_dumps: dict[str, Any] = {}
        self.started_at = time.time()
        from relocator.agent.lastwords import LastWords

        self.last_words_of = LastWords(self.state_dir)  # a crashed worker's log, kept
        self.warm = WarmStarts(node, self._cluster_base(), fetch=self.fetch_warm_from_peers)  # issue 28
        self.adopted = self._adopt()

    # -- helpers ----------------------------------------------------------------------------
    def _lock(self, cell_id: str) -> threading.Lock:
        with self._guard:
            return self._locks[cell_id]

    def _adopt(self) -> list[str]:
        """Re-adopt the cells recorded on this node; forget records of dead ones."""
        from relocator.cell.cell import list_cells

        adopted = []
        for cell in list_cells():
            if cell.is_alive():
                adopted.append(cell.id)
            else:
                cell.kill()  # removes the record and the network namespace
        return adopted

    @staticmethod
    def _wait_criu(cell, timeout: float = 120.0) -> None:
        """A `criu dump -t <init>` left running by a previous incarnation of this agent (killed
        mid-dump; CRIU is not killed with it) still holds the cell and will leave it stopped:
        wait for it, as the cell lock would have (found by `relocator chaos`)."""
        from relocator.agent.postcopy import LazySource
        from relocator.procs import process_table

        pid = str(cell.init_pid)
        # a lazy dump that serves its pages (post-copy) holds the tree until the target has them
        # all: it is not an operation to wait for (resume and kill end it)
        serving = LazySource(cell.dir).info() is not None

        def none_left() -> bool:
            return not any(argv[0].endswith("criu") and "-t" in argv and pid in argv
                           and not (serving and "--lazy-pages" in argv)
                           for _, argv in process_table().values() if argv)

        settle(none_left, timeout, every=0.1)  # then on regardless, as before

    @staticmethod
    def _describe(cell) -> dict[str, Any]:
        return {"id": cell.id, "endpoint": cell.endpoint, "alive": cell.is_alive(),
                "stopped": cell.is_stopped(), "init_pid": cell.init_pid, "origin": cell.origin,
                "model": cell.launch.get("served_model_name"), "created_at": cell.created_at}

    # -- reporting --------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {"node": self.node, "pid": os.getpid(), "adopted": self.adopted,
                "started_at": self.started_at, "state_dir": str(self.state_dir), "swept": self.swept}

    def gpus(self) -> list[dict[str, Any]]:
        """This node's real GPUs through NVML (index, UUID, model, memory); [] where there are
        none (Ray's GPU counts are then fake)."""
        from relocator.gpus import local_gpus

        return [g.to_dict() for g in local_gpus()]

    # -- health: NVML facts and node notices for the policies (relocator.agent.health) ---------
    def _health(self):
        if getattr(self, "_health_reader", None) is None:
            from relocator.agent.health import HealthReader

            self._health_reader = HealthReader(self.node, self.state_dir.parent)
        return self._health_reader

    def health(self) -> dict[str, Any]:
        """Each GPU's health (Xids, pending row remaps, ECC, heat) and this node's notice, if any."""
        return self._health().read()

    def set_notice(self, at: float | None, reason: str = "") -> dict[str, Any] | None:
        """Write (or, with `at` None, remove) this node's notice: "it goes away at `at`"."""
        from relocator.agent.health import clear_notice, write_notice

        if at is None:
            clear_notice(self.state_dir.parent)
            return None
        return write_notice(self.state_dir.parent, at, reason)

    def clear_gpu(self, index: int) -> None:
        """GPU `index` was reset: forget its Xids (on fake GPUs, its marked faults too)."""
        self._health().clear(index)

    def mark_gpus(self, total: int, kind: str, gpus: list[int], count: int, avoid: list[int]) -> list[int]:
        """Fake GPUs only: GPUs `gpus`, or `count` of those not in `avoid`, read as `kind`
        (relocator.agent.fakenvml.MARKS) from now on; the indexes marked."""
        return self._health().mark(total, kind, gpus, count, avoid)

    def cells(self) -> list[dict[str, Any]]:
        from relocator.cell.cell import list_cells

        return [self._describe(c) for c in list_cells()]

    def cell_state(self, cell_id: str) -> str:
        """A CellState: running | stopped | absent; waits for any operation in progress on the cell."""
        from relocator.cell.cell import CellError, CellState, load_cell

        with self._lock(cell_id):
            try:
                cell = load_cell(cell_id)
            except CellError:
                self.last_words_of.keep(cell_id)
                return CellState.ABSENT
            if not cell.is_alive():
                self.last_words_of.keep(cell_id)
                return CellState.ABSENT
            self.last_words_of.watch(cell.id, cell.log_path)
            self._wait_criu(cell)
            return cell.state()

    def host_fingerprint(self) -> dict:
        from relocator.snapshot.fingerprint import host_fingerprint

        return host_fingerprint().model_dump()

    def worker_profile(self, cell_id: str) -> dict[str, Any]:
        """What a move's PLAN needs of a worker on this (source) node: its fingerprint, the
        launch record and engine the target fingerprints itself against, and how big its image
        will be about (`image_bytes`: see _image_size_hint)."""
        from relocator.cell.cell import load_cell
        from relocator.snapshot.snapshot import fingerprint_of

        cell = load_cell(cell_id)
        return {"fingerprint": fingerprint_of(cell).model_dump(), "launch": cell.launch, "engine": cell.engine,
                "image_bytes": _image_size_hint(cell)}

    def compatible(self, fingerprint: dict, launch: dict | None = None, engine: str | None = None) -> list[str]:
        """Reasons this node cannot restore a worker with `fingerprint` (empty: it can). With the
        worker's `launch` record (and `engine`), the engine part is this node's own for it (its
        engine version, its weights' hash): what restore will expect, computed now (at PLAN,
        not in the worker's freeze) and cached for the restore. Without, the host part only."""
        from relocator.snapshot.fingerprint import Fingerprint, compatibility, host_fingerprint
        from relocator.snapshot.snapshot import engine_fingerprint_for

        fp = Fingerprint.model_validate(fingerprint)
        if launch is None:
            engine_fp = fp.engine
        else:
            try:
                engine_fp = engine_fingerprint_for(launch, engine or fp.engine.engine)
            except Exception as exc:  # noqa: BLE001 - a target that cannot fingerprint cannot restore
                return [f"engine: cannot fingerprint {engine or fp.engine.engine} here "
                        f"({type(exc).__name__}: {exc})"]
        target = Fingerprint(host=host_fingerprint(), engine=engine_fp)
        return [str(m) for m in compatibility(fp, target)]

    # -- lifecycle --------------------------------------------------------------------------
    def launch(self, cell_id: str, model_dir: str, served_name: str, port: int | None = None,
               gpu_ids: list[int] | None = None, ready_timeout: float = 600.0,
               extra: dict | None = None, engine: str | None = None, nice: int | None = None) -> dict[str, Any]:
        """Start a worker in cell `cell_id`; `nice`: the start and the copy at that CPU priority (a
        handoff's target next to its serving source; the controller sets it back at SWITCH)."""
        from adapters.base import DEFAULT_ENGINE
        from relocator.worker import default_spec

        engine = engine or DEFAULT_ENGINE
        with self._lock(cell_id):
            spec = default_spec(Path(model_dir), served_name, port, engine=engine)
            for k, v in (extra or {}).items():
                setattr(spec, k, v)
            cell_gpus = None
            if gpu_ids is not None:
                from relocator.cell.devices import host_gpus

                if gpu_ids and host_gpus():
                    # real GPUs: the cell gets exactly these, numbered 0..n-1 inside it
                    cell_gpus = list(gpu_ids)
                else:
                    # fake GPUs (Ray's counts on a CPU host): only the variable, as before
                    spec.env = {**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}
            t0 = time.monotonic()
            # a warm restore of its kind when the node has one, else cold (and captured)
            cell, ready_s, warm = self.warm.start(spec, engine, cell_id, cell_gpus, ready_timeout, nice=nice)
            self.last_words_of.watch(cell.id, cell.log_path)
            return {**self._describe(cell), "ready_s": round(ready_s, 3),
                    "launch_s": round(time.monotonic() - t0, 3), "warm": warm}

    def dump(self, cell_id: str, image_dir: str, page_server: dict | None = None) -> dict[str, Any]:
        """Checkpoint a cell into `image_dir`; with `page_server` ({address, port}: the target's,
        see open_page_server) its memory goes straight there and only the small images stay.
        Its `credential` (this move's, made by the target) is on disk only during the dump."""
        from relocator.agent import locallink
        from relocator.agent.front import move_credential
        from relocator.cell.cell import load_cell
        from relocator.snapshot import dump

        with self._lock(cell_id):
            t0 = time.monotonic()
            with locallink.route(page_server) as ps, move_credential(page_server, ps) as tls_dir:
                img = dump(load_cell(cell_id), Path(image_dir), page_server=ps, tls_dir=tls_dir)
            return {"image_dir": str(img.path), "bytes": img.bytes, "seconds": round(time.monotonic() - t0, 3),
                    "timings": img.manifest.timings, "pages": img.manifest.pages.value}

    def signal(self, cell_id: str, sig: int) -> None:
        """Send `sig` to every process of a cell (SIGSTOP: paused in place, preemption.InPlace;
        `resume` continues it)."""
        from relocator.cell.cell import load_cell

        with self._lock(cell_id):
            load_cell(cell_id).signal_tree(int(sig))

    def resume(self, cell_id: str) -> None:
        from relocator.cell.cell import load_cell
        from relocator.snapshot import resume_source

        from relocator.agent.postcopy import LazySource

        with self._lock(cell_id):
            cell = load_cell(cell_id)
            # a post-copy that is given up: its lazy dump (still serving, or hung on a cut
            # link) must let go of the tree first
            LazySource(cell.dir).abort(self._lazy_dumps.pop(cell_id, None))
            self._wait_criu(cell)
            # always, even if its tasks run: a `criu dump` killed midway (with an agent that
            # died) releases the tasks but leaves CRIU's packet filter in the cell's netns
            resume_source(cell)

    def restore(self, image_dir: str, cell_id: str, ready_timeout: float = 120.0,
                verify: str = "auto", gpu_ids: list[int] | None = None,
                page_source: dict | None = None) -> dict[str, Any]:
        """Restore into cell `cell_id`. `verify` as in `RestoreTarget`: "auto" re-hashes the
        files unless this host hashed these very files already (a dump here, or a verified
        transfer, leaves a stamp); the manifest digest and the fingerprint are always checked.
        `gpu_ids`: this node's GPU indices for the copy (a GPU image only; on fake-GPU nodes the
        image holds no devices and they are ignored).
        `page_source` ({address, port}, optional stall_s, throttle_bps): post-copy: the image is
        a lazy dump's and its memory comes from that page server while the copy already runs
        (postcopy_status / postcopy_wait follow it)."""
        from relocator.agent import locallink
        from relocator.agent.postcopy import TargetSession, stop_keeper
        from relocator.snapshot import RestoreTarget, restore
        from relocator.worker import wait_ready

        with self._lock(cell_id):
            t0 = time.monotonic()
            lazy = None
            if page_source:
                lazy = TargetSession(page_source["address"], int(page_source["port"]),
                                     stall_s=float(page_source.get("stall_s", 3.0)),
                                     throttle_bps=float(page_source.get("throttle_bps", 0.0)),
                                     pump_port=int(page_source.get("pump_port") or 0),
                                     pump_unix=locallink.same_host(page_source, "pump_unix"),
                                     credential=page_source.get("credential"))
            cell = restore(Path(image_dir), RestoreTarget(cell_id=cell_id, verify=verify, gpu_ids=gpu_ids),
                           lazy=lazy)
            restored = time.monotonic() - t0
            self.last_words_of.watch(cell.id, cell.log_path)
            try:
                # post-copy: every probe may wait on pages still on their way
                ready = asyncio.run(wait_ready(cell, timeout=ready_timeout, poll=0.02 if lazy else 0.05))
            except BaseException:
                stop_keeper(cell.dir)
                self.last_words_of.forget(cell.id)
                cell.kill()
                raise
            out = {**self._describe(cell), "criu_restore_s": round(restored, 3), "health_s": round(ready, 3),
                   "seconds": round(time.monotonic() - t0, 3)}
            try:  # where the restore's time went (snapshot.restore writes it)
                out["timings"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in
                                  json.loads((cell.dir / "restore_timings.json").read_text()).items()}
            except (OSError, ValueError):
                pass
            if lazy:
                out["postcopy"] = self._postcopy_state(cell.dir)
            return out

    def last_words(self, cell_id: str) -> str | None:
        """The end of the log of a cell that died by itself (not killed), once found dead."""
        return self.last_words_of.read(cell_id)

    def kill(self, cell_id: str) -> bool:
        from relocator.agent.postcopy import LazySource, stop_keeper
        from relocator.cell.cell import CellError, load_cell

        with self._lock(cell_id):
            try:
                cell = load_cell(cell_id)
            except CellError:
                return False
            stop_keeper(cell.dir)  # a post-copy target: its keeper and lazy-pages daemon
            lazy = self._lazy_dumps.pop(cell_id, None)
            if LazySource(cell.dir).running():  # a post-copy source: its lazy dump
                LazySource(cell.dir).abort(lazy)
            _report_if_ran(cell)
            self.last_words_of.forget(cell_id)
            cell.kill()
            return True

    def kill_all(self) -> list[str]:
        from relocator.cell.cell import list_cells

        killed = []
        for cell in list_cells():
            with self._lock(cell.id):
                self.last_words_of.forget(cell.id)
                cell.kill()
                killed.append(cell.id)
        return killed

    # -- images ------------------------------------------------------------------------------
    def image_dir(self, name: str) -> str:
        return str(self.images_dir / name)

    def transient_image_dir(self, name: str, size_hint: int | None = None,
                            mode: str = "auto") -> dict[str, Any]:
        """Where this node keeps image `name` that lives only until it is restored here (stream,
        postcopy): {"path", "on": tmpfs | disk, "why"}, or {"refused": why} when `mode` is
        tmpfs and this node has no tmpfs with room (relocator.agent.transient)."""
        from relocator.agent import transient as T

        try:
            mode = T.TransientImages(mode)
        except ValueError as exc:
            return {"refused": str(exc)}
        tmpfs = T.node_images(self._cluster_base(), self.node)
        try:
            on, why = T.decide(mode, size_hint, T.probe(tmpfs))
        except T.TransientRefused as exc:
            return {"refused": f"{tmpfs}: {exc}"}
        if on == "tmpfs":
            try:
                T.make_node_images(self._cluster_base(), self.node)
            except OSError as exc:
                if mode is T.TransientImages.TMPFS:
                    return {"refused": f"{tmpfs}: {exc}"}
                return {"path": self.image_dir(name), "on": "disk", "why": f"tmpfs: {exc}"}
            return {"path": str(tmpfs / name), "on": "tmpfs", "why": why}
        return {"path": self.image_dir(name), "on": "disk", "why": why}

    def _cluster_base(self) -> Path:
        """The cluster's base directory: images_dir is <base>/nodes/<node>/images."""
        return Path(os.path.normpath(self.images_dir / ".." / ".." / ".."))

    def remove_image(self, image_dir: str) -> None:
        rx = self._receivers.pop(str(image_dir), None)
        if rx is not None:  # a streamed dump that failed: its page server may still wait
            rx.abort()
        path = Path(image_dir).resolve()
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)

    def stream_image(self, image_dir: str, chunk_bytes: int = 16 << 20) -> Iterator[list]:
        """Chunks of an image for a peer agent (a Ray streaming generator), in batches of about
        `chunk_bytes`: an image has ~100 small files, and one Ray object each cost more than
        their bytes (0.3-0.4 s of a streamed move's TRANSFER on a loaded machine)."""
        from relocator.agent.transfer import iter_chunks

        yield from batched_arrays(iter_chunks(image_dir, chunk_bytes), chunk_bytes)

    def receive_image(self, src_node: str, src_image_dir: str, dst_image_dir: str,
                      chunk_bytes: int = 16 << 20) -> dict[str, Any]:
        """Pull an image from the agent of `src_node`, chunk by chunk, checksummed. When its
        memory was streamed into `dst_image_dir` by this node's page server (open_page_server),
        only the other images travel here, and the manifest is completed with the page files
        hashed on arrival."""
        import ray

        from relocator.agent.pagestream import complete_manifest, landed
        from relocator.agent.transfer import receive_chunks

        t0 = time.monotonic()
        rx = self._receivers.pop(str(dst_image_dir), None)
        pages = None
        if rx is not None:
            try:
                pages = rx.finish()
            except BaseException:
                self.remove_image(dst_image_dir)
                raise
        elif Path(dst_image_dir).is_dir() and any(Path(dst_image_dir).iterdir()):
            # this agent restarted after the page server ended: hash the pages now
            from relocator.agent.pagestream import _hash_now
            from relocator.snapshot.images import check_pages

            problems = check_pages(Path(dst_image_dir))
            if problems:
                self.remove_image(dst_image_dir)
                from relocator.agent.transfer import TransferError

                raise TransferError("streamed memory incomplete: " + "; ".join(problems[:3]))
            files = _hash_now(Path(dst_image_dir))
            pages = {"files": files, "page_bytes": sum(f.size for f in files.values()), "rehashed": True}

        src = ray.get_actor(agent_name(src_node), namespace=NAMESPACE)
        # at most 4 chunks in flight: the image never has to fit in the object store
        gen = src.stream_image.options(num_returns="streaming", _generator_backpressure_num_objects=4).remote(
            src_image_dir, chunk_bytes)
        out = receive_chunks(pulled_chunks(gen), dst_image_dir, present=landed if pages is not None else None)
        if pages is not None:
            complete_manifest(Path(dst_image_dir), pages.pop("files"))
            out = {**out, "streamed_pages_bytes": pages["page_bytes"],
                   "bytes": out["bytes"] + pages["page_bytes"], **{k: v for k, v in pages.items() if k != "page_bytes"},
                   "seconds": round(time.monotonic() - t0, 3)}
        return out


def _image_size_hint(cell) -> int | None:
    """About how big an image of `cell` will be: the resident + swapped memory of its processes
    (cheap: /proc/<pid>/status of each; an upper bound of the anonymous memory CRIU dumps, as
    it counts file-backed pages too), plus the memory of its GPUs (a GPU image holds what
    cuda-checkpoint moved to the host: bounded by the devices' total). None: unknown (the
    target assumes transient.FALLBACK_IMAGE_BYTES)."""
    from relocator.procs import status_bytes

    total = status_bytes(cell.pids(), ("VmRSS", "VmSwap"))
    if cell.gpu_ids:
        try:
            from relocator.gpus import local_gpus

            mine = set(cell.gpu_ids)
            total += sum(g.memory_mib << 20 for g in local_gpus() if g.index in mine)
        except Exception:  # noqa: BLE001 - NVML unavailable: the host part alone
            pass
    return total or None


def start_agent(node: str, ray_node_id: str, state_dir: str, images_dir: str,
                credentials: dict[str, str] | None = None):
    """The agent actor of `node`, created (pinned to its Ray node) or found by name;
    `credentials`: its bundle (relocator.credentials.for_node), written on its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(NodeAgent)
    return actor_cls.options(
        name=agent_name(node), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=16, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
        runtime_env={"env_vars": {"RELOCATOR_STATE_DIR": state_dir}},
    ).remote(node, state_dir, images_dir, credentials)
