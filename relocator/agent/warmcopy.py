"""Warm images copied between nodes (issue 28): an agent serves an image of its store to a peer
agent and fetches one from a peer into its own store, over the same checksummed chunk stream
as a relocation's image (relocator.agent.transfer: every file hashed on arrival against the
sender's manifest, the manifest's HMAC checked with the cluster's image key when the store
files it). A copy either lands whole and verified or leaves nothing.

Two uses: the controller copies every image ahead of need to `prefetch.copies` other nodes
(relocator.controller.warmcopies), so no host is the only holder; and a start that finds no
image of its kind on its node fetches it from a peer that has one before starting cold.

Where the peer's store is on this host, in this mount namespace (several nodes of one machine:
the CPU reference's two raylets), the copy reads the peer's image in place, held shared in the
peer's store, and writes, hashes and files it in this thread: no byte goes through the raylets'
object stores, whose transfer runs at their nice 0 whatever the copy's ends run at (issue 29: a
handoff's on-demand copy of ~1 GB took 16 s of its target's start that way, and the longest
client gap of the move fell in it). Elsewhere (other hosts, emulated hosts' own namespaces) the
copy goes through Ray as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from relocator import procs
from relocator.procs import this_thread_niced

log = logging.getLogger("relocator.agent")
#: how long a start asks each peer whether it holds an image (a lost node must not stall it)
PEER_ASK_S = 3.0


def batched_arrays(chunks: Iterator[tuple], chunk_bytes: int) -> Iterator[list]:
    """Image chunks in batches of about `chunk_bytes`, each datum a uint8 array: an image has
    ~100 small files and one Ray object each costs more than their bytes; arrays are read
    straight out of the object store (zero copy), 3x faster than bytes, which Ray pickles."""
    import numpy as np

    batch: list[tuple] = []
    size = 0
    for name, offset, data, digest in chunks:
        batch.append((name, offset, np.frombuffer(data, dtype=np.uint8), digest))
        size += len(data)
        if size >= chunk_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def pulled_chunks(gen: Any) -> Iterator[tuple]:
    """The chunks of a peer's streaming generator of batches (`batched_arrays`), one at a time;
    each batch's object is let go as soon as it is read, so at most the generator's backpressure
    window is held."""
    import ray

    for ref in gen:
        batch = ray.get(ref)
        del ref
        while batch:
            name, offset, data, digest = batch.pop(0)
            yield (name, offset, memoryview(data), digest)


class CopyCancelled(RuntimeError):
    """A copy ahead of need stopped because the controller asked (a move or a start began)."""


def _ray_cancelled() -> bool:
    """Whether Ray cancelled the task this runs in (ray.cancel of a threaded actor's task only
    sets a flag); False outside a Ray task."""
    try:
        import ray

        # outside Ray (a unit test) get_runtime_context would connect to a cluster first
        return ray.is_initialized() and bool(ray.get_runtime_context().is_canceled())
    except Exception:  # noqa: BLE001 - a driver, not a task
        return False


def until_cancelled(chunks: Iterator[tuple], stop: threading.Event, what: str) -> Iterator[tuple]:
    """`chunks` until `stop` is set or Ray cancels this task: then CopyCancelled (the receiver
    drops what it wrote)."""
    for chunk in chunks:
        if stop.is_set() or _ray_cancelled():
            raise CopyCancelled(f"{what}: cancelled (a relocation or a start began)")
        yield chunk


def host_id() -> str:
    """What makes a path name the same file in two agents: this boot of the host and this mount
    namespace (an emulated host has its own: the same path there is another file)."""
    return f"{procs.boot_id()}/{procs.ns_inode('mnt')}"


def where_held(image_dir: Path) -> dict[str, Any]:
    """A peer's answer to `warm_where`: the image's directory and its identity on this host."""
    st = image_dir.stat()
    return {"path": str(image_dir), "dev": st.st_dev, "ino": st.st_ino, "host": host_id()}


def readable_here(where: dict[str, Any] | None) -> Path | None:
    """The peer's image directory when this agent can read it in place (same host and mount
    namespace, the very same directory, readable), else None: the copy goes through Ray."""
    if not where:
        return None
    try:
        if where.get("host") != host_id():
            return None
        path = Path(where["path"])
        st = path.stat()
        if (st.st_dev, st.st_ino) != (where["dev"], where["ino"]) or not os.access(path, os.R_OK | os.X_OK):
            return None
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return path


def sender_niced(background: bool) -> bool:
    """Whether the peer sends at nice 19: a copy ahead of need, or one this thread waits for at
    low priority (a handoff's target copy starting beside its serving source, often on the
    sender's node: relocator.warm.lowstart)."""
    return background or os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) > 0


def peer_nodes(me: str) -> list[str]:
    """The nodes whose agents run in this cluster (their named actors), this one left out."""
    import ray

    from relocator.agent.names import NAMESPACE, agent_name

    prefix = agent_name("")
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"][len(prefix):] for a in names
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix) and a["name"] != agent_name(me))


def _stop_stream(gen: Any) -> None:
    """Stop the holder's side of a copy that ended early (its task sees Ray's cancel flag)."""
    try:
        import ray

        ray.cancel(gen)
    except Exception as exc:  # noqa: BLE001 - it ends when the generator is collected anyway
        log.info("warm copy stream not cancelled: %s", exc)


def copy_local(store: Any, image_dir: Path, key: str, chunk_bytes: int, background: bool,
               stop: threading.Event, what: str) -> tuple[dict, Any]:
    """Copy a peer's image on this host into `store`, in this thread (at nice 19 for a copy
    ahead of need; a start's copy runs at the start's nice): the peer's image held shared while
    it is read, every file hashed against its manifest as it is written (as over Ray), filed.
    (figures with via "local", the store's entry); CopyCancelled on `stop`, nothing left."""
    from relocator.agent.transfer import iter_chunks, receive_chunks
    from relocator.warm.start import NoWarmImage
    from relocator.warm.store import held_image

    staged = store.staging(key)
    with this_thread_niced(19 if background else None):
        try:
            with held_image(image_dir) as path:
                if path is None:
                    raise NoWarmImage(f"{what}: the image was removed meanwhile")
                staged.rmdir()  # receive_chunks makes it, and removes it on any failure
                got = receive_chunks(until_cancelled(iter_chunks(path, chunk_bytes), stop, what), staged)
        except BaseException:
            store.discard(staged)
            raise
        return {**got, "via": "local"}, store.commit(key, staged)


class WarmCopyOps:
    """The agent's side of copying warm images (mixed into NodeAgent, which gives `node`,
    `warm` (relocator.warm.launch.WarmStarts))."""

    node: str
    warm: Any
    _copy_guard = threading.Lock()
    _copying: dict[str, threading.Lock] = {}
    _cancels: dict[str, threading.Event] = {}  # key -> set to stop its copy ahead of need

    def warm_keys(self) -> list[str]:
        """The keys of this node's warm images."""
        from relocator.warm.config import WarmConfig

        return [e.key for e in self.warm.store(WarmConfig.load()).list()]

    def stream_warm(self, key: str, chunk_bytes: int = 16 << 20, background: bool = True) -> Iterator[list]:
        """The chunks of this node's image of `key` (a Ray streaming generator), held in the
        store while they are read so no eviction removes it meanwhile; `background` (a copy
        ahead of need): at nice 19, so a move or a worker on this node keeps the CPU."""
        from relocator.agent.transfer import iter_chunks
        from relocator.warm.config import WarmConfig
        from relocator.warm.start import NoWarmImage

        with self.warm.store(WarmConfig.load()).use(key) as entry:
            if entry is None:
                raise NoWarmImage(f"node {self.node} holds no warm image {key}")
            with this_thread_niced(19 if background else None):
                for batch in batched_arrays(iter_chunks(entry.path, chunk_bytes), chunk_bytes):
                    if _ray_cancelled():  # the receiver gave up (ray.cancel): let the image go
                        return
                    yield batch

    def fetch_warm(self, src_node: str, key: str, chunk_bytes: int = 16 << 20,
                   background: bool = True) -> dict[str, Any]:
        """Copy the image of `key` from `src_node`'s store into this node's: {copied, bytes,
        seconds, why}. The store's room is checked first (StoreFull before a byte travels), the
        image verified before it is filed (ImageError or TransferError raise and leave nothing);
        one copy of a key at a time on this node. `background` (ahead of need) runs both ends at
        nice 19 and stops on `cancel_warm_copy` (CopyCancelled, nothing left); a start waiting
        for it (on demand) does neither."""
        from relocator.warm.config import WarmConfig

        stop = self._cancel_event(key) if background else threading.Event()
        try:
            store = self.warm.store(WarmConfig.load())
            with self._copy_lock(key):
                if store.path_of(key).is_dir():
                    return {"copied": False, "key": key, "from": src_node, "why": "already here"}
                if stop.is_set():
                    raise CopyCancelled(f"warm image {key} from {src_node}: cancelled before it began")
                t0 = time.monotonic()
                got, entry = self._receive(store, src_node, key, chunk_bytes, background, stop)
        finally:
            if background:
                with self._copy_guard:
                    if self._cancels.get(key) is stop:
                        self._cancels.pop(key, None)
        secs = time.monotonic() - t0
        log.info("warm image %s copied from %s: %d bytes in %.2fs", key, src_node, entry.bytes, secs)
        return {"copied": True, "key": key, "from": src_node, "bytes": entry.bytes, "seconds": round(secs, 3),
                "gb_per_s": got.get("gb_per_s"), "via": got.get("via", "ray")}

    def _receive(self, store: Any, src_node: str, key: str, chunk_bytes: int, background: bool,
                 stop: threading.Event) -> tuple[dict, Any]:
        """The transfer itself: room checked, chunks pulled until done or `stop`, filed."""
        import ray

        from relocator.agent.names import NAMESPACE, agent_name
        from relocator.agent.transfer import receive_chunks
        from relocator.warm.start import NoWarmImage

        src = ray.get_actor(agent_name(src_node), namespace=NAMESPACE)
        size = ray.get(src.warm_bytes.remote(key), timeout=PEER_ASK_S)
        if size is None:
            raise NoWarmImage(f"node {src_node} holds no warm image {key}")
        store.check_room(int(size))
        try:
            local = readable_here(ray.get(src.warm_where.remote(key), timeout=PEER_ASK_S))
        except Exception as exc:  # noqa: BLE001 - an older peer, or a slow one: through Ray
            log.info("warm image %s: where %s holds it is not known (%s): copied through Ray", key, src_node, exc)
            local = None
        if local is not None:
            return copy_local(store, local, key, chunk_bytes, background, stop, f"warm image {key} from {src_node}")
        gen = src.stream_warm.options(num_returns="streaming", _generator_backpressure_num_objects=4).remote(
            key, chunk_bytes, sender_niced(background))
        staged = store.staging(key)
        with this_thread_niced(19 if background else None):  # hashing 1 GB is CPU
            try:
                staged.rmdir()  # receive_chunks makes it, and removes it on any failure
                got = receive_chunks(until_cancelled(pulled_chunks(gen), stop, f"warm image {key} from {src_node}"),
                                     staged)
            except BaseException:
                store.discard(staged)
                _stop_stream(gen)
                raise
            return {**got, "via": "ray"}, store.commit(key, staged)

    def fetch_warm_from_peers(self, key: str) -> dict[str, Any] | None:
        """A start's on-demand copy: the image of `key` from the first peer that holds it, or
        None when no live peer does (each asked for at most PEER_ASK_S)."""
        import ray

        from relocator.agent.names import NAMESPACE, agent_name

        for peer in peer_nodes(self.node):
            try:
                handle = ray.get_actor(agent_name(peer), namespace=NAMESPACE)
                if key not in ray.get(handle.warm_keys.remote(), timeout=PEER_ASK_S):
                    continue
                return self.fetch_warm(peer, key, background=False)
            except Exception as exc:  # noqa: BLE001 - that peer is gone or failed: ask the next
                log.warning("warm image %s not fetched from %s: %s", key, peer, exc)
        return None

    def warm_where(self, key: str) -> dict[str, Any] | None:
        """Where this node's image of `key` lies, for a peer on this host to read it in place
        (`readable_here`); None: none here."""
        from relocator.warm.config import WarmConfig

        path = self.warm.store(WarmConfig.load()).path_of(key)
        return where_held(path) if path.is_dir() else None

    def warm_bytes(self, key: str) -> int | None:
        """The size of this node's image of `key` (None: none here): a copy checks room first."""
        from relocator.warm.config import WarmConfig

        store = self.warm.store(WarmConfig.load())
        return next((e.bytes for e in store.list() if e.key == key), None)

    def cancel_warm_copy(self, key: str) -> bool:
        """Stop this node's copy ahead of need of `key` (the controller: a move or a start began);
        its partial image is dropped. False when none runs."""
        with self._copy_guard:
            ev = self._cancels.get(key)
        if ev is None:
            return False
        ev.set()
        return True

    def _cancel_event(self, key: str) -> threading.Event:
        with self._copy_guard:
            ev = self._cancels[key] = threading.Event()
        return ev

    def _copy_lock(self, key: str) -> threading.Lock:
        with self._copy_guard:
            return self._copying.setdefault(key, threading.Lock())
