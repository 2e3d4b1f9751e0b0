"""Device profile: what a cell needs from the host to use its assigned NVIDIA GPUs.

Given the host GPU indices assigned to a worker, a cell gets:

- the device nodes of exactly those GPUs, `/dev/nvidia<minor>`, plus the driver's shared nodes
  when the host has them: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools,
  /dev/nvidia-modeset and /dev/nvidia-caps/*. They are *created* with mknod (same major:minor
  and mode as the host's) in the cell's own tmpfs /dev, not bind-mounted: a tmpfs's content is
  part of a CRIU image (CRIU archives it and recreates the nodes on restore), whereas a bind
  mount of a host devtmpfs file is a mount CRIU would have to be told about (--external) on
  both sides, with the same path on both. After cuda-checkpoint the process holds no
  /dev/nvidia* fd or mapping, so the nodes are plain directory entries that `retarget` can
  rewrite for the target's GPUs after `criu restore` and before `cuda-checkpoint --action
  restore`.
- Names: a GPU's node keeps its *host* name, /dev/nvidia<minor>. libcuda and NVML do not look
  a GPU up by position: the kernel driver reports each GPU's minor number (the "Device Minor"
  of /proc/driver/nvidia/gpus/<bus>/information) and the library opens /dev/nvidia<minor>. A
  node renamed to /dev/nvidia0 that holds another GPU's minor would be opened as the wrong GPU
  or not at all. NVIDIA's container toolkit (libnvidia-container) keeps host names for the
  same reason. What is stable across a move is the *CUDA ordinal* inside the cell: the cell
  can open only its own GPUs, so its first GPU is always cuda:0 (CUDA_VISIBLE_DEVICES=0..n-1
  inside the cell, never host indices), and the node name is rewritten on the target.
- /proc/driver/nvidia: as libnvidia-container does, a tmpfs over the cell's
  /proc/driver/nvidia with copies of `version`, `registry` and `params` (with
  `ModifyDeviceFiles: 0`, so that libcuda/nvidia-modprobe never create nodes for GPUs the cell
  was not given), and `gpus/<bus>/information` for the assigned GPUs only. Plain files in a
  tmpfs again: in the image, and rewritten by `retarget`.
- the driver's user-space library mounts (containers and some VMs keep libcuda on its own mount,
  e.g. /usr/local/nvidia): a cell binds / non-recursively, so they are bound recursively into
  the cell. CRIU cannot dump such a mount (a squashfs): it must be external on dump and restore
  (`criu_external_args`).
- the environment: CUDA_VISIBLE_DEVICES=0..n-1, CUDA_DEVICE_ORDER=PCI_BUS_ID,
  NVIDIA_VISIBLE_DEVICES=all (every GPU the cell has), NVIDIA_DRIVER_CAPABILITIES, the host's
  LD_LIBRARY_PATH (the driver's libraries), RELOCATOR_GPU_IDS (host indices at launch: frozen in
  the image, informational only).

A cell is not a security boundary: its processes are root without a device cgroup and could
mknod any node. The profile keeps honest workers on their own GPUs.

Testing without a GPU: RELOCATOR_DEV_DIR points at a directory of fake character nodes used in
place of /dev, RELOCATOR_NVIDIA_PROC at a fake /proc/driver/nvidia.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relocator import procs

NVIDIA_MAJOR = 195
SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
CAPS_DIR = "nvidia-caps"
PROC_FILES = ("version", "registry", "params")
_GPU_NODE = re.compile(r"^nvidia(\d+)$")


class DeviceError(RuntimeError):
    pass


def dev_dir() -> Path:
    return Path(os.environ.get("RELOCATOR_DEV_DIR") or "/dev")


def proc_dir() -> Path:
    return Path(os.environ.get("RELOCATOR_NVIDIA_PROC") or "/proc/driver/nvidia")


@dataclass
class Node:
    path: str  # relative to /dev: "nvidia3", "nvidia-caps/nvidia-cap1"
    major: int
    minor: int
    mode: int = 0o666


@dataclass
class Gpu:
    index: int  # host index (PCI bus order, as nvidia-smi and NVML number them)
    minor: int  # the driver's device minor: the node is /dev/nvidia<minor>
    uuid: str = ""
    bus_id: str = ""
    model: str = ""


@dataclass
class DeviceProfile:
    gpus: list[Gpu] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    proc_files: dict[str, str] = field(default_factory=dict)  # relative to /proc/driver/nvidia
    driver_mounts: list[str] = field(default_factory=list)
    host_env: dict[str, str] = field(default_factory=dict)

    @property
    def gpu_ids(self) -> list[int]:
        return [g.index for g in self.gpus]

    def env(self) -> dict[str, str]:
        if not self.gpus:
            return {}
        return {
            **self.host_env,
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(self.gpus))),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "NVIDIA_VISIBLE_DEVICES": "all",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "RELOCATOR_GPU_IDS": ",".join(str(i) for i in self.gpu_ids),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "DeviceProfile":
        data = data or {}
        return cls(gpus=[Gpu(**g) for g in data.get("gpus", [])],
                   nodes=[Node(**n) for n in data.get("nodes", [])],
                   proc_files=dict(data.get("proc_files", {})),
                   driver_mounts=list(data.get("driver_mounts", [])),
                   host_env=dict(data.get("host_env", {})))


def _char_node(path: Path) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISCHR(st.st_mode) else None


def _parse_information(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def host_gpus(dev: Path | None = None, proc: Path | None = None) -> list[Gpu]:
    """The host's GPUs in index order. From the driver's /proc/driver/nvidia/gpus/<bus>/
    information (bus order = nvidia-smi's and NVML's index, each with its device minor and
    UUID); without it (fake device dirs), from the /dev/nvidia<N> nodes, index = rank of minor."""
    dev, proc = dev or dev_dir(), proc or proc_dir()
    gpus_dir = proc / "gpus"
    if gpus_dir.is_dir():
        out = []
        for i, bus in enumerate(sorted(os.listdir(gpus_dir))):
            try:
                info = _parse_information((gpus_dir / bus / "information").read_text())
                minor = int(info["Device Minor"])
            except (OSError, KeyError, ValueError):
                continue
            out.append(Gpu(index=i, minor=minor, uuid=info.get("GPU UUID", ""), bus_id=bus,
                           model=info.get("Model", "")))
        if out:
            return out
    minors = []
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    for name in names:
        m = _GPU_NODE.match(name)
        if m and _char_node(dev / name) is not None:
            minors.append(int(m.group(1)))
    return [Gpu(index=i, minor=minor) for i, minor in enumerate(sorted(minors))]


def driver_mounts(mountinfo: str | None = None) -> list[str]:
    """Host mount points that hold the driver's user-space (their path names nvidia), outside
    /dev, /proc, /sys and /run (which a cell replaces)."""
    if mountinfo is None:
        mountinfo = procs.mountinfo()
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        mp = fields[4].replace("\\040", " ")
        if "nvidia" in mp and not mp.startswith(("/dev", "/proc", "/sys", "/run")) and mp not in out:
            out.append(mp)
    return out


def proc_view(gpus: list[Gpu], proc: Path | None = None) -> dict[str, str]:
    """The files of the cell's /proc/driver/nvidia (relative paths -> content)."""
    proc = proc or proc_dir()
    if not proc.is_dir():
        return {}
    files: dict[str, str] = {}
    for name in PROC_FILES:
        try:
            text = (proc / name).read_text()
        except OSError:
            continue
        if name == "params":
            text = re.sub(r"(?m)^ModifyDeviceFiles:.*$", "ModifyDeviceFiles: 0", text)
        files[name] = text
    for gpu in gpus:
        if gpu.bus_id:
            try:
                files[f"gpus/{gpu.bus_id}/information"] = (proc / "gpus" / gpu.bus_id / "information").read_text()
            except OSError:
                pass
    return files


def profile_for(gpu_ids: list[int] | None, *, dev: Path | None = None, proc: Path | None = None,
                mountinfo: str | None = None) -> DeviceProfile:
    """The profile of a cell given host GPU indices `gpu_ids` (empty/None: no GPU, empty
    profile). Refuses an index the host does not have, or a GPU without its node."""
    if not gpu_ids:
        return DeviceProfile()
    dev = dev or dev_dir()
    if len(set(gpu_ids)) != len(gpu_ids):
        raise DeviceError(f"GPU ids assigned twice: {gpu_ids}")
    by_index = {g.index: g for g in host_gpus(dev, proc)}
    missing = [i for i in gpu_ids if i not in by_index]
    if missing:
        raise DeviceError(f"host has no GPU with index {missing} (has {sorted(by_index)}; device dir {dev})")
    gpus = sorted((by_index[i] for i in gpu_ids), key=lambda g: (g.bus_id, g.minor))
    nodes = []
    for gpu in gpus:
        st = _char_node(dev / f"nvidia{gpu.minor}")
        if st is None:
            raise DeviceError(f"GPU {gpu.index}: no character device {dev}/nvidia{gpu.minor}")
        nodes.append(Node(f"nvidia{gpu.minor}", os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)))
    for name in SHARED_NODES:
        st = _char_node(dev / name)
        if st is not None:
            nodes.append(Node(name, os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)))
    if (dev / CAPS_DIR).is_dir():
        for name in sorted(os.listdir(dev / CAPS_DIR)):
            st = _char_node(dev / CAPS_DIR / name)
            if st is not None:
                nodes.append(Node(f"{CAPS_DIR}/{name}", os.major(st.st_rdev), os.minor(st.st_rdev),
                                  stat.S_IMODE(st.st_mode)))
    host_env = {}
    if os.environ.get("LD_LIBRARY_PATH"):
        host_env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    fake = "RELOCATOR_DEV_DIR" in os.environ
    return DeviceProfile(gpus=gpus, nodes=nodes, proc_files=proc_view(gpus, proc),
                         driver_mounts=[] if fake else driver_mounts(mountinfo), host_env=host_env)


def _is_nvidia(name: str) -> bool:
    return name.startswith("nvidia")


def write_nodes(profile: DeviceProfile, dev_root: Path) -> None:
    """Make `dev_root` (a cell's /dev, seen from inside or through /proc/PID/root/dev) hold
    exactly the profile's NVIDIA nodes: every other nvidia* entry is removed first."""
    for name in os.listdir(dev_root):
        if not _is_nvidia(name):
            continue
        path = dev_root / name
        if path.is_dir() and not path.is_symlink():
            for sub in os.listdir(path):
                os.unlink(path / sub)
            os.rmdir(path)
        else:
            os.unlink(path)
    for node in profile.nodes:
        path = dev_root / node.path
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, stat.S_IFCHR | node.mode, os.makedev(node.major, node.minor))
        os.chmod(path, node.mode)


def write_proc(profile: DeviceProfile, proc_root: Path) -> None:
    """Fill a cell's /proc/driver/nvidia tmpfs (already mounted at `proc_root`) from the profile,
    removing what is there (a restored image's view of its source GPUs)."""
    for dirpath, dirnames, filenames in os.walk(proc_root, topdown=False):
        for f in filenames:
            os.unlink(os.path.join(dirpath, f))
        for d in dirnames:
            os.rmdir(os.path.join(dirpath, d))
    for rel, text in profile.proc_files.items():
        path = proc_root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.chmod(path, 0o444)


def retarget(init_pid: int, profile: DeviceProfile) -> None:
    """After `criu restore` of a GPU cell on another host or other GPUs, and before
    `cuda-checkpoint --action restore`: swap the source's nodes and /proc view inside the
    restored cell for the target's (the image carries the source's)."""
    root = procs.root(init_pid)
    write_nodes(profile, root / "dev")
    if profile.proc_files and (root / "proc/driver/nvidia").is_dir():
        write_proc(profile, root / "proc/driver/nvidia")


def device_map(source: DeviceProfile, target: DeviceProfile) -> str:
    """cuda-checkpoint's `--device-map` for a move: the source's i-th GPU to the target's i-th
    (both in bus order, so cuda:i stays cuda:i). Every checkpointed GPU must be mapped."""
    if len(source.gpus) != len(target.gpus):
        raise DeviceError(f"source has {len(source.gpus)} GPUs, target {len(target.gpus)}")
    pairs = []
    for s, t in zip(source.gpus, target.gpus):
        if not s.uuid or not t.uuid:
            raise DeviceError("GPU UUIDs unknown (no /proc/driver/nvidia): cannot build a device map")
        pairs.append(f"{s.uuid}={t.uuid}")
    return ",".join(pairs)


def criu_external_args(profile: DeviceProfile) -> tuple[list[str], list[str]]:
    """(dump args, restore args) that make the driver's library mounts external to the image:
    CRIU cannot dump them (squashfs) and the target binds its own."""
    dump, restore = [], []
    for i, mp in enumerate(profile.driver_mounts):
        key = f"nvdrv{i}"
        dump += ["--external", f"mnt[{mp}]:{key}"]
        restore += ["--external", f"mnt[{key}]:{mp}"]
    return dump, restore
