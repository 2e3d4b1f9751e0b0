"""Warm images copied between nodes (issue 28): an agent serves an image of its store to a peer
agent and fetches one from a peer into its own store, over the same checksummed chunk stream
as a relocation's image (relocator.agent.transfer: every file hashed on arrival against the
sender's manifest, the manifest's HMAC checked with the cluster's image key when the store
files it). A copy either lands whole and verified or leaves nothing.

Two uses: the controller copies every image ahead of need to `prefetch.copies` other nodes
(relocator.controller.warmcopies), so no host is the only holder; and a start that finds no
image of its kind on its node fetches it from a peer that has one before starting cold.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

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


def peer_nodes(me: str) -> list[str]:
    """The nodes whose agents run in this cluster (their named actors), this one left out."""
    import ray

    from relocator.agent.names import NAMESPACE, agent_name

    prefix = agent_name("")
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"][len(prefix):] for a in names
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix) and a["name"] != agent_name(me))


class WarmCopyOps:
    """The agent's side of copying warm images (mixed into NodeAgent, which gives `node`,
    `warm` (relocator.warm.launch.WarmStarts))."""

    node: str
    warm: Any
    _copy_guard = threading.Lock()
    _copying: dict[str, threading.Lock] = {}

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
                yield from batched_arrays(iter_chunks(entry.path, chunk_bytes), chunk_bytes)

    def fetch_warm(self, src_node: str, key: str, chunk_bytes: int = 16 << 20,
                   background: bool = True) -> dict[str, Any]:
        """Copy the image of `key` from `src_node`'s store into this node's: {copied, bytes,
        seconds, why}. Verified before it is filed (StoreFull, ImageError or TransferError
        raise and leave nothing); one copy of a key at a time on this node. `background` (ahead
        of need) runs both ends at nice 19; a start waiting for it (on demand) does not."""
        import ray

        from relocator.agent.names import NAMESPACE, agent_name
        from relocator.agent.transfer import receive_chunks
        from relocator.warm.config import WarmConfig

        store = self.warm.store(WarmConfig.load())
        with self._copy_lock(key):
            if store.path_of(key).is_dir():
                return {"copied": False, "key": key, "from": src_node, "why": "already here"}
            t0 = time.monotonic()
            src = ray.get_actor(agent_name(src_node), namespace=NAMESPACE)
            gen = src.stream_warm.options(num_returns="streaming", _generator_backpressure_num_objects=4).remote(
                key, chunk_bytes, background)
            staged = store.staging(key)
            with this_thread_niced(19 if background else None):  # hashing 1 GB is CPU
                try:
                    staged.rmdir()  # receive_chunks makes it, and removes it on any failure
                    got = receive_chunks(pulled_chunks(gen), staged)
                except BaseException:
                    store.discard(staged)
                    raise
                entry = store.commit(key, staged)
        secs = time.monotonic() - t0
        log.info("warm image %s copied from %s: %d bytes in %.2fs", key, src_node, entry.bytes, secs)
        return {"copied": True, "key": key, "from": src_node, "bytes": entry.bytes, "seconds": round(secs, 3),
                "gb_per_s": got.get("gb_per_s")}

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

    def _copy_lock(self, key: str) -> threading.Lock:
        with self._copy_guard:
            return self._copying.setdefault(key, threading.Lock())
