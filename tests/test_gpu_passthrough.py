"""GPU pass-through for cells (relocator.cell.devices) against a fake device directory.

Real cells (namespaces, pivot_root, mknod) with fake NVIDIA character nodes: what a cell's /dev
and environment hold for given host GPU indices. The driver itself is only on GPU hosts; the
test that needs it is skipped elsewhere and says so.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from relocator.cell import devices
from relocator.cell.cell import launch_cell, using_state_dir

NV = devices.NVIDIA_MAJOR
UVM_MAJOR, CAPS_MAJOR = 510, 237
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
                                reason="cells need root, ip and unshare (namespaces, mknod)")


def _mknod(path: Path, major: int, minor: int, mode: int = 0o666) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)  # not the umask's


@pytest.fixture
def fake_dev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if os.geteuid() != 0:
        pytest.skip("creating character device nodes (mknod) needs root")
    dev = tmp_path / "dev"
    for minor in range(4):
        _mknod(dev / f"nvidia{minor}", NV, minor)
    _mknod(dev / "nvidiactl", NV, 255)
    _mknod(dev / "nvidia-modeset", NV, 254)
    _mknod(dev / "nvidia-uvm", UVM_MAJOR, 0)
    _mknod(dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
    _mknod(dev / "nvidia-caps" / "nvidia-cap1", CAPS_MAJOR, 1, 0o400)
    _mknod(dev / "nvidia-caps" / "nvidia-cap2", CAPS_MAJOR, 2, 0o444)
    (dev / "null").write_text("")  # not a char device: ignored
    monkeypatch.setenv("RELOCATOR_DEV_DIR", str(dev))
    monkeypatch.setenv("RELOCATOR_NVIDIA_PROC", str(tmp_path / "no-driver"))
    return dev


def _nvidia_nodes(dev_root: Path) -> dict[str, tuple[int, int, int]]:
    """Every nvidia* entry under a /dev: relative path -> (major, minor, mode)."""
    out = {}
    for dirpath, _dirs, files in os.walk(dev_root):
        for f in files:
            path = Path(dirpath) / f
            rel = str(path.relative_to(dev_root))
            if not rel.startswith("nvidia"):
                continue
            st = os.lstat(path)
            assert stat.S_ISCHR(st.st_mode), f"{rel} is not a character device"
            out[rel] = (os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode))
    return out


SHARED = {"nvidiactl": (NV, 255, 0o666), "nvidia-modeset": (NV, 254, 0o666),
          "nvidia-uvm": (UVM_MAJOR, 0, 0o666), "nvidia-uvm-tools": (UVM_MAJOR, 1, 0o666),
          "nvidia-caps/nvidia-cap1": (CAPS_MAJOR, 1, 0o400), "nvidia-caps/nvidia-cap2": (CAPS_MAJOR, 2, 0o444)}


def test_profile_holds_exactly_the_assigned_gpus(fake_dev: Path) -> None:
    profile = devices.profile_for([3, 1])
    assert profile.gpu_ids == [1, 3]  # bus (here: minor) order, whatever order they were given in
    nodes = {n.path: (n.major, n.minor, n.mode) for n in profile.nodes}
    assert nodes == {"nvidia1": (NV, 1, 0o666), "nvidia3": (NV, 3, 0o666), **SHARED}
    env = profile.env()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["RELOCATOR_GPU_IDS"] == "1,3"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert devices.DeviceProfile.from_dict(profile.to_dict()) == profile


def test_no_gpus_is_an_empty_profile_and_unknown_ids_are_refused(fake_dev: Path) -> None:
    assert devices.profile_for(None) == devices.DeviceProfile() and devices.profile_for([]).env() == {}
    with pytest.raises(devices.DeviceError, match="no GPU with index \\[7\\]"):
        devices.profile_for([0, 7])
    with pytest.raises(devices.DeviceError, match="twice"):
        devices.profile_for([1, 1])


def test_proc_view_from_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU indices, minors and UUIDs from /proc/driver/nvidia/gpus; params with ModifyDeviceFiles 0;
    only the assigned GPUs' information."""
    proc = tmp_path / "proc"
    for bus, minor in (("0000:1a:00.0", 2), ("0000:05:00.0", 0)):
        (proc / "gpus" / bus).mkdir(parents=True)
        (proc / "gpus" / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-{minor:04d}\nBus Location: \t {bus}\nDevice Minor: \t {minor}\n")
    (proc / "params").write_text("ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\n")
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n")
    gpus = devices.host_gpus(tmp_path / "none", proc)
    assert [(g.index, g.minor, g.uuid) for g in gpus] == [(0, 0, "GPU-0000"), (1, 2, "GPU-0002")]
    view = devices.proc_view([gpus[1]], proc)
    assert "ModifyDeviceFiles: 0" in view["params"] and "ModifyDeviceFiles: 1" not in view["params"]
    assert set(view) == {"params", "version", "gpus/0000:1a:00.0/information"}
    src = devices.DeviceProfile(gpus=[gpus[0]])
    dst = devices.DeviceProfile(gpus=[gpus[1]])
    assert devices.device_map(src, dst) == "GPU-0000=GPU-0002"
    with pytest.raises(devices.DeviceError):
        devices.device_map(src, devices.DeviceProfile())


def test_driver_mounts_and_criu_externals() -> None:
    mountinfo = ("22 1 0:21 / / rw - ext4 /dev/sda rw\n"
                 "40 22 7:0 / /usr/local/nvidia ro - squashfs /dev/loop0 ro\n"
                 "41 22 0:5 / /dev/nvidia0 rw - devtmpfs udev rw\n"
                 "42 22 0:6 / /proc/driver/nvidia rw - proc proc rw\n")
    assert devices.driver_mounts(mountinfo) == ["/usr/local/nvidia"]
    dump, restore = devices.criu_external_args(devices.DeviceProfile(driver_mounts=["/usr/local/nvidia"]))
    assert dump == ["--external", "mnt[/usr/local/nvidia]:nvdrv0"]
    assert restore == ["--external", "mnt[nvdrv0]:/usr/local/nvidia"]


def _wait_root(pid: int, timeout: float = 10.0) -> Path:
    """The cell's root once its init has pivoted (its /dev is the cell's tmpfs)."""
    root = Path(f"/proc/{pid}/root")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (root / "run" / "launch.json").exists() and (root / "dev" / "null").exists():
                return root
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"cell init {pid} did not build its root")


def _worker_env(cell) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in cell.pids()[1:]:
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if b"time.sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
        time.sleep(0.05)
    raise AssertionError("worker did not start")


@needs_root
@pytest.mark.parametrize("gpu_ids", [[2], [1, 3], None])
def test_cell_gets_exactly_its_gpus(fake_dev: Path, tmp_path: Path, gpu_ids: list[int] | None) -> None:
    with using_state_dir(tmp_path / "state"):
        cell = launch_cell(SLEEPER, {"CUDA_VISIBLE_DEVICES": "9"}, 8000, gpu_ids=gpu_ids)
        try:
            root = _wait_root(cell.init_pid)
            found = _nvidia_nodes(root / "dev")
            env = _worker_env(cell)
            if gpu_ids is None:
                assert found == {}, "a CPU cell has no NVIDIA node"
                assert cell.devices == {} and cell.gpu_ids == []
                assert env["CUDA_VISIBLE_DEVICES"] == "9"  # CPU behaviour unchanged
                return
            expected = {f"nvidia{i}": (NV, i, 0o666) for i in gpu_ids}
            assert found == {**expected, **SHARED}
            assert cell.gpu_ids == gpu_ids
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(len(gpu_ids))))
            assert env["RELOCATOR_GPU_IDS"] == ",".join(map(str, gpu_ids))
            # the usual nodes are still there
            assert os.major(os.stat(root / "dev" / "null").st_rdev) == 1
        finally:
            cell.kill()


@needs_root
def test_retarget_swaps_the_nodes_of_a_running_cell(fake_dev: Path, tmp_path: Path) -> None:
    """What a restore onto other GPUs does between `criu restore` and cuda restore."""
    with using_state_dir(tmp_path / "state"):
        cell = launch_cell(SLEEPER, {}, 8000, gpu_ids=[0])
        try:
            root = _wait_root(cell.init_pid)
            devices.retarget(cell.init_pid, devices.profile_for([3]))
            assert _nvidia_nodes(root / "dev") == {"nvidia3": (NV, 3, 0o666), **SHARED}
        finally:
            cell.kill()


@needs_root
def test_unknown_gpu_is_refused_before_a_cell_starts(fake_dev: Path, tmp_path: Path) -> None:
    with using_state_dir(tmp_path / "state"):
        with pytest.raises(devices.DeviceError):
            launch_cell(SLEEPER, {}, 8000, gpu_ids=[5])
        assert not list((tmp_path / "state").glob("cells/*/cell.json"))


@pytest.mark.skipif(not Path("/dev/nvidiactl").exists(), reason="needs an NVIDIA GPU and driver (no /dev/nvidiactl)")
def test_torch_sees_exactly_one_gpu_in_a_cell(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    out = tmp_path / "out"
    argv = [sys.executable, "-c",
            f"import torch; open('/proc/1/root{out}', 'w').write(str(torch.cuda.device_count())); import time; time.sleep(60)"]
    with using_state_dir(tmp_path / "state"):
        cell = launch_cell(argv, {}, 8000, gpu_ids=[devices.host_gpus()[-1].index])
        try:
            deadline = time.monotonic() + 60
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert out.read_text() == "1", cell.log_tail()
        finally:
            cell.kill()


@needs_root
@pytest.mark.integration
def test_restore_onto_other_gpus_gives_the_copy_the_targets_nodes(fake_dev: Path, tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    """A GPU worker (reference engine, computing on CPU here) dumped with GPU 0 and restored
    with GPU 2: the image records the source's GPUs, the restored cell holds exactly GPU 2's
    node and the shared ones (retargeted after `criu restore`), its record says GPU 2, and it
    serves. Asking for a different number of GPUs than the image holds is refused before
    anything starts. (The cuda restore with --device-map runs only on GPU hosts.)"""
    import asyncio

    from relocator.snapshot import RestoreTarget, SnapshotError, dump, restore
    from relocator.worker import default_spec, launch_worker, wait_ready

    with using_state_dir(tmp_path / "state"):
        cell = launch_worker(default_spec(tiny_model_dir, engine="reference"), engine="reference", gpu_ids=[0])
        restored = None
        try:
            asyncio.run(wait_ready(cell, timeout=120))
            img = dump(cell, tmp_path / "image")
            assert devices.DeviceProfile.from_dict(img.manifest.cell.devices).gpu_ids == [0]
            with pytest.raises(SnapshotError, match="holds 1 GPU"):
                restore(img, RestoreTarget(gpu_ids=[1, 2]))
            restored = restore(img, RestoreTarget(gpu_ids=[2]))
            assert restored.gpu_ids == [2]
            root = Path(f"/proc/{restored.init_pid}/root")
            assert _nvidia_nodes(root / "dev") == {"nvidia2": (NV, 2, 0o666), **SHARED}
            asyncio.run(wait_ready(restored, timeout=120))
        finally:
            if restored is not None:
                restored.kill()
            cell.kill()
