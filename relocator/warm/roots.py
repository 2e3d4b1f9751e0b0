"""Which directory holds a node's warm images: a tmpfs where it fits, else disk.

tmpfs pages are RAM, so `auto` takes the tmpfs only when it, and the memory left, have room for
the whole bound (plus headroom). The choice sticks: a node whose store already exists in one
of the two places keeps using it, so its images are never split between them.
"""

from __future__ import annotations

import re
from pathlib import Path

from relocator.agent.transient import HEADROOM_BYTES, Space, probe
from relocator.warm.config import StoreRoot, WarmConfig
from relocator.warm.store import ImageStore


_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class NoTmpfsRoom(RuntimeError):
    """`root: tmpfs` and the tmpfs cannot take the store's bound."""


def _tmpfs_problem(space: Space, max_bytes: int) -> str | None:
    need = max_bytes + HEADROOM_BYTES
    gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
    if space.fstype != "tmpfs":
        return f"not a tmpfs ({space.fstype or 'unknown filesystem'})"
    if space.free_bytes < need:
        return f"{gib(space.free_bytes)} free, the store may hold {gib(need)}"
    if space.mem_available is not None and space.mem_available < need:
        return f"only {gib(space.mem_available)} of memory available for up to {gib(need)}"
    return None


def store_root(cfg: WarmConfig, node: str, dirs: tuple[Path, Path] | None = None) -> tuple[Path, str]:
    """(the node's store directory, why there); `dirs`: (tmpfs, disk) instead of the config's."""
    if not _NODE.match(node) or ".." in node:
        raise ValueError(f"not a node name: {node!r}")
    section = cfg.store
    tmpfs, disk = dirs or (Path(section.tmpfs_dir) / node, Path(section.disk_dir) / node)
    if section.root is StoreRoot.DISK:
        return disk, "root: disk"
    if section.root is StoreRoot.AUTO:
        for path in (tmpfs, disk):
            if (path / "images").is_dir():
                return path, "the node's store is already there"
    problem = _tmpfs_problem(probe(tmpfs), section.max_bytes)
    if problem is None:
        return tmpfs, "the tmpfs has room for the whole bound"
    if section.root is StoreRoot.TMPFS:
        raise NoTmpfsRoom(f"root: tmpfs, but {tmpfs}: {problem}")
    return disk, f"tmpfs: {problem}"


def open_store(node: str = "local", cfg: WarmConfig | None = None) -> ImageStore:
    """The warm image store of `node` on this machine (emulated nodes each have their own)."""
    cfg = cfg or WarmConfig.load()
    root, _why = store_root(cfg, node)
    return ImageStore(root, cfg.store.max_bytes)


def cluster_dirs(base_dir: str | Path, node: str) -> tuple[Path, Path]:
    """(tmpfs, disk) of `node`'s store in the cluster of `base_dir`: under the cluster's tmpfs
    root and its node directory, so `relocator down` removes both with the cluster (and the
    leak check, which looks at `<node>/images/*`, does not count them)."""
    from relocator.agent.transient import transient_root

    return transient_root(base_dir) / node / "warm", Path(base_dir) / "nodes" / node / "warm"


def open_cluster_store(base_dir: str | Path, node: str, cfg: WarmConfig | None = None) -> ImageStore:
    """The store an agent of the cluster of `base_dir` keeps for `node`."""
    from relocator.agent.transient import make_node_images

    cfg = cfg or WarmConfig.load()
    root, _why = store_root(cfg, node, cluster_dirs(base_dir, node))
    if root == cluster_dirs(base_dir, node)[0]:
        make_node_images(base_dir, node)  # writes the root's base marker, which `down` reads
    return ImageStore(root, cfg.store.max_bytes)
