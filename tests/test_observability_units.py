"""Issue 18 without a cluster: the controller's metrics derived from its records, its /metrics
endpoint, the event log (cursor, long poll, JSON lines), the state machine's events, and the
router's blackout measure over real HTTP against fake engines."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relocator.controller.events import EventKind, EventLog
from relocator.controller.inventory import NodeInfo
from relocator.controller.machine import Machine
from relocator.controller.metrics import MetricsServer, registry
from relocator.controller.model import PHASES, Relocation, WorkerRecord
from relocator.controller.store import Store
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.fakeserver import start_fake, write_fake_tokenizer
from relocator.router.server import RouterServer
from tests.test_controller_machine import FakeBackend

NODES = {"n1": NodeInfo("n1", "a", 4, 2), "n2": NodeInfo("n2", "b", 4, 4), "n3": NodeInfo("n3", "c", 4, 0, False)}


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels...): value} of a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def scrape(store: Store) -> dict[tuple, float]:
    from prometheus_client import generate_latest

    return samples(generate_latest(registry(store, lambda: NODES)).decode())


@pytest.fixture
def store(tmp_path):
    st = Store(tmp_path / "c.db")
    st.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=2, cell_id="c1", endpoint="http://a",
                                state="running", reservation="pg-w1"))
    return st


def test_metrics_are_derived_from_the_records(store) -> None:
    events: list[tuple[str, dict]] = []
    be = FakeBackend()
    m = Machine(store, be, on_event=lambda k, f: events.append((k, f)))
    assert m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2")).result == "done"
    assert m.run(Relocation(id="r2", worker="w1", src="n2", dst="n1", transfer="stream",
                            faults={"restore": True})).result == "rolled_back"
    got = scrape(store)
    lab = {"transfer": "shared", "engine": "vllm"}
    assert got[("relocator_relocations_total", *sorted({**lab, "result": "done", "reason": "none"}.items()))] == 1
    assert got[("relocator_relocations_total", *sorted({"transfer": "stream", "engine": "vllm",
                                                        "result": "rolled_back", "reason": "fault_injected"}.items()))] == 1
    assert got[("relocator_rollbacks_total", ("from_phase", "RESTORE"))] == 1
    for p in PHASES:  # r1 ran all eight, r2 up to RESTORE
        n = 2 if PHASES.index(p) <= PHASES.index("RESTORE") else 1
        assert got[("relocator_relocation_phase_seconds_count", ("phase", p))] == n, p
        assert got[("relocator_relocation_phase_seconds_bucket", ("le", "+Inf"), ("phase", p))] == n
    assert got[("relocator_image_bytes_count",)] == 2 and got[("relocator_image_bytes_sum",)] == 2 * 1234
    assert got[("relocator_workers", ("engine", "vllm"), ("state", "running"))] == 1
    assert got[("relocator_workers", ("engine", "vllm"), ("state", "lost"))] == 0
    assert got[("relocator_node_gpus", ("kind", "free"), ("node", "n1"))] == 2
    assert got[("relocator_node_gpus", ("kind", "total"), ("node", "n2"))] == 4
    assert got[("relocator_node_up", ("node", "n3"))] == 0
    assert got[("relocator_relocations_running",)] == 0
    # the scheduling layer's facts: a pending launch demand, a suspended worker
    from relocator.controller.model import Demand, DemandKind

    store.save_demand(Demand(id="w9", kind=DemandKind.LAUNCH, model="m", gpus=4))
    w = store.worker("w1")
    w.state = "suspended"
    store.save_worker(w)
    got = scrape(store)
    assert got[("relocator_pending_demands", ("kind", "launch"))] == 1
    assert got[("relocator_suspended_workers",)] == 1
    # the machine's events: every phase change, the rollback, each end
    kinds = [k for k, _ in events]
    assert kinds[:2] == [EventKind.RELOCATION_STARTED, EventKind.PHASE_STARTED]
    assert kinds.count(EventKind.PHASE_STARTED) == kinds.count(EventKind.PHASE_ENDED) == 8 + 6
    assert kinds.count(EventKind.ROLLBACK) == 1 and kinds[-1] == EventKind.RELOCATION_FINISHED
    fin = [f for k, f in events if k == EventKind.RELOCATION_FINISHED]
    assert [(f["relocation"], f["result"], f["reason"]) for f in fin] == [
        ("r1", "done", "none"), ("r2", "rolled_back", "fault_injected")]
    assert [f["from_phase"] for k, f in events if k == EventKind.ROLLBACK] == ["RESTORE"]


def test_metrics_endpoint_serves_and_keeps_its_port(tmp_path, store) -> None:
    srv = MetricsServer(store, lambda: NODES)
    try:
        with urllib.request.urlopen(srv.url, timeout=5) as r:
            text = r.read().decode()
        assert srv.url.startswith("http://127.0.0.1:")
        assert ("relocator_node_gpus", ("kind", "total"), ("node", "n1")) in samples(text)
        port = srv.port
    finally:
        srv.close()
    again = MetricsServer(store, lambda: NODES)  # a restarted controller: same store, same port
    try:
        assert again.port == port
    finally:
        again.close()


def test_event_log_cursor_long_poll_and_json_lines(tmp_path, store) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(store, path)
    log.emit(EventKind.NODE_LOST, {"node": "n3"})
    start = log.last
    assert log.wait(0, timeout=0)["events"][0]["kind"] == "node_lost"
    t = threading.Timer(0.3, lambda: log.emit("worker_lost", {"worker": "w1", "node": "n3"}))
    t.start()
    t0 = time.monotonic()
    got = log.wait(start, timeout=10)  # wakes when the event is emitted, not at the timeout
    assert 0.2 < time.monotonic() - t0 < 5
    assert [e["kind"] for e in got["events"]] == ["worker_lost"] and got["cursor"] == start + 1
    assert log.wait(got["cursor"], timeout=0.05) == {"events": [], "cursor": got["cursor"]}
    # a new log on the same store (a restarted controller) continues the numbering
    assert EventLog(store).last == got["cursor"]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines][-2:] == ["node_lost", "worker_lost"] and lines[-1]["worker"] == "w1"


async def test_router_measures_the_blackout_of_a_switch(tmp_path) -> None:
    fakes, runners = [], []
    for _ in range(2):
        eng, runner, url = await start_fake("fake")
        fakes.append((eng, url))
        runners.append(runner)
    s = RouterSettings(port=0, control_port=0, backends=[BackendConfig(
        model="fake", url=fakes[0][1], worker_id="w1", tokenizer=str(write_fake_tokenizer(tmp_path)))])
    srv = await RouterServer(s).start()
    try:
        async with aiohttp.ClientSession() as session:
            fakes[0][0].knobs.stall_after = 5  # like a frozen (dumped) worker

            async def stream() -> bytes:
                async with session.post(srv.url + "/v1/completions", json={
                        "model": "fake", "prompt": "abc", "max_tokens": 20, "stream": True}) as r:
                    return await r.read()

            task = asyncio.create_task(stream())
            for _ in range(300):
                await asyncio.sleep(0.01)
                if fakes[0][0]._stalls:
                    break
            await asyncio.sleep(0.4)  # the pause the client sees
            async with RouterControl(srv.control_url) as rc:
                await rc.hold("w1")
                assert (await rc.switch("w1", fakes[1][1]))["moved_streams"] == 1
            assert (await task).endswith(b"data: [DONE]\n\n")
            fakes[0][0].unstall()
            async with session.get(srv.url + "/metrics") as r:
                got = samples(await r.text())
            assert got[("relocator_relocation_blackout_seconds_count",)] == 1
            assert 0.4 <= got[("relocator_relocation_blackout_seconds_sum",)] < 5
            assert got[("relocator_relocation_blackout_seconds_bucket", ("le", "0.25"))] == 0
            # no stream in flight, one request held: its wait until the switch is the pause
            async with RouterControl(srv.control_url) as rc:
                await rc.hold("w1")
                task = asyncio.create_task(stream())
                await asyncio.sleep(0.6)
                await rc.switch("w1", fakes[0][1])
            assert (await task).endswith(b"data: [DONE]\n\n")
            async with session.get(srv.url + "/metrics") as r:
                got2 = samples(await r.text())
        assert got2[("relocator_relocation_blackout_seconds_count",)] == 2
        second = got2[("relocator_relocation_blackout_seconds_sum",)] - got[("relocator_relocation_blackout_seconds_sum",)]
        assert 0.6 <= second < 5
    finally:
        await srv.stop()
        for r in runners:
            await r.cleanup()


def test_dashboard_reads_only_these_metrics(store) -> None:
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from relocator.router.metrics import PromHooks

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    text = generate_latest(registry(store, lambda: NODES)) + generate_latest(PromHooks().registry)
    exposed = {f.name + sfx for f in text_string_to_metric_families(text.decode()) for sfx in suffixes[f.type]}
    dash = json.loads((Path(__file__).parents[1] / "docs" / "grafana" / "relocator.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b[a-z_]+(?=[{\[ )]|$)", e) if m.startswith("relocator_")}
    assert used and used <= exposed, used - exposed
    assert {"relocator_relocation_blackout_seconds_bucket", "relocator_rollbacks_total",
            "relocator_node_gpus"} <= used


def test_client_events_iterator_follows_the_cursor(store) -> None:
    from relocator.controller.api import ControllerClient

    log = EventLog(store)

    class Local(ControllerClient):  # the actor call replaced by the controller's own methods
        def _call(self, method, *args, timeout=None, **kw):
            return {"events_cursor": lambda: log.last, "wait_events": log.wait}[method](*args, **kw)

    ctl = Local(handle=None)
    log.emit(EventKind.NODE_LOST, {"node": "n0"})  # before the subscription: not seen from now on
    it = ctl.events(idle_timeout=1.0, wait_s=0.5)  # "now" is this call
    threading.Timer(0.2, lambda: [log.emit(EventKind.WORKER_LOST, {"worker": "w1"}),
                                  log.emit(EventKind.NODE_LOST, {"node": "n3"})]).start()
    got = list(it)
    assert [e["kind"] for e in got] == ["worker_lost", "node_lost"]
    assert [e["kind"] for e in ctl.events(since=0, kinds=["node_lost"], idle_timeout=0)] == ["node_lost"] * 2
    assert list(ctl.events(since=got[-1]["seq"], idle_timeout=0)) == []
    with pytest.raises(ValueError):
        list(ctl.events(kinds=["no_such_kind"], idle_timeout=0))
