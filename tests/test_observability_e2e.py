"""Issue 18 on the session's shared cluster (`relocator_cluster`): a real Prometheus (Debian's
`prometheus` binary) scrapes the controller's and the router's /metrics, both named by
`status()["metrics"]`, on loopback; a live move under streaming load; then PromQL through
Prometheus' HTTP API returns the relocation (by result), its phases and its blackout, and the
totals equal the controller's own records (so every relocation of the session, the chaos
smoke's included when it ran before, is in Prometheus with the right result and phases). The
move's events arrive through `relocator.connect().events()` and in DIR/events.jsonl.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from relocator.cluster.scenario import relocate_under_load
from relocator.ports import free_port
from tests.helpers import why_not_done

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(scope="module")
def prometheus(relocator_cluster, tmp_path_factory):
    """Prometheus scraping the cluster every second; yields its base URL."""
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is absent (Debian: apt-get install prometheus; "
                    "scripts/install.sh installs it)")
    targets = relocator_cluster.status()["metrics"]
    d = tmp_path_factory.mktemp("prometheus")
    jobs = "".join(f"  - job_name: relocator-{job}\n    metrics_path: {urlsplit(url).path}\n"
                   f"    static_configs: [{{targets: ['{urlsplit(url).netloc}']}}]\n"
                   for job, url in sorted(targets.items()))
    (d / "prometheus.yml").write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                                      f"scrape_configs:\n{jobs}")
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: requests.get(url + "/-/ready", timeout=2).status_code == 200, 60, "prometheus ready")
        wait_for(lambda: sum(v for _, v in query(url, 'up{job=~"relocator-.*"}')) == 2, 30,
                 "both targets up")
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
            if got:
                return got
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def query(prom: str, promql: str) -> list[tuple[dict, float]]:
    r = requests.get(prom + "/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]


def by(prom: str, promql: str, label: str) -> dict[str, float]:
    return {m.get(label, ""): v for m, v in query(prom, promql)}


DOC_EXAMPLES = [  # docs/observability.md
    "histogram_quantile(0.99, sum by (le) (increase(relocator_relocation_blackout_seconds_bucket[1d])))",
    "sum by (from_phase) (increase(relocator_rollbacks_total[1d]))",
    'relocator_node_gpus{kind="free"}',
]


def dashboard_exprs() -> list[str]:
    dash = json.loads((Path(__file__).parents[1] / "docs" / "grafana" / "relocator.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_live_move_in_prometheus_and_events(relocator_cluster, prometheus) -> None:
    ctl = relocator_cluster
    w = ctl.launch(MODEL, gpus=1, worker_id="obs1")
    events: list[dict] = []
    stop = threading.Event()

    def listen(cursor: int) -> None:  # a platform reacting to events, started before the move
        while not stop.is_set():  # (idle_timeout only so that the test can end it)
            for ev in ctl.events(since=cursor, idle_timeout=1, wait_s=1):
                events.append(ev)
                cursor = ev["seq"]

    t = threading.Thread(target=listen, args=(ctl.status()["events"]["last"],), daemon=True)
    try:
        before_blackout = query(prometheus, "relocator_relocation_blackout_seconds_count")
        before_n = before_blackout[0][1] if before_blackout else 0.0
        before_sum = sum(v for _, v in query(prometheus, "relocator_relocation_blackout_seconds_sum"))
        t.start()
        time.sleep(0.5)
        res = relocate_under_load(ctl, w["id"], None, MODEL, concurrency=4, max_tokens=96, warmup_s=1.5)
        rel, load = res["relocation"], res["load"]
        assert rel["result"] == "done", why_not_done(rel)
        assert load["client_errors"] == 0 and load["tokens_lost"] == 0, load
        rels = [ctl.get_relocation(r["id"]) for r in ctl.status()["relocations"]]
        finished = [r for r in rels if r["result"] != "running"]
        want_results = Counter(r["result"] for r in finished)
        want_phases = Counter(p["name"] for r in rels for p in r["phases"] if p.get("ended") is not None)

        # -- the relocation, its phases and its blackout, through PromQL --------------------
        wait_for(lambda: by(prometheus, "sum by (result) (relocator_relocations_total)", "result") == want_results,
                 30, f"relocations by result == {dict(want_results)}")
        assert by(prometheus, "sum by (phase) (relocator_relocation_phase_seconds_count)", "phase") == want_phases
        mine = by(prometheus, 'relocator_relocations_total{result="done",reason="none",transfer="shared"}', "engine")
        assert mine.get(w["engine"], 0) >= 1, mine
        assert all(v >= 0 for v in by(prometheus, "sum by (phase) (relocator_relocation_phase_seconds_sum)",
                                      "phase").values())
        assert by(prometheus, 'histogram_quantile(0.99, sum by (le) (relocator_relocation_phase_seconds_bucket'
                              '{phase="DUMP"}))', "")[""] > 0
        try:
            n = wait_for(lambda: [v for _, v in query(prometheus, "relocator_relocation_blackout_seconds_count")
                                  if v > before_n], 30, "the move's blackout")[0]
        except AssertionError:
            st = ctl.status()
            router = requests.get(st["metrics"]["router"], timeout=5).text
            log = (Path(st["events"]["log"]).parent / "router.log").read_text()[-3000:]
            raise AssertionError(f"no blackout: {before_n=} prom={query(prometheus, 'relocator_relocation_blackout_seconds_count')} "
                                 f"router={[x for x in router.splitlines() if 'blackout' in x]} log={log}") from None
        assert n == before_n + 1  # one switch with streams in flight: this move's
        blackout = sum(v for _, v in query(prometheus, "relocator_relocation_blackout_seconds_sum")) - before_sum
        # the router's figure is the client's, less the client's own latency to the router
        assert 0 < blackout <= load["blackout_max_s"] + 0.25, (blackout, load["blackout_max_s"])
        print(f"blackout: router {blackout:.3f}s, client {load['blackout_max_s']:.3f}s")
        st = ctl.status()
        free = by(prometheus, 'relocator_node_gpus{kind="free"}', "node")
        assert set(free) == {n["id"] for n in st["nodes"]}
        assert by(prometheus, 'relocator_workers{state="running"}', "engine").get(w["engine"], 0) >= 1

        # -- every expression of the example dashboard and of docs/observability.md runs --------
        for expr in dashboard_exprs() + DOC_EXAMPLES:
            query(prometheus, expr)

        # -- events: the API stream and the JSON lines ----------------------------------------
        wait_for(lambda: any(e["kind"] == "relocation_finished" and e["relocation"] == rel["id"] for e in events),
                 30, "relocation_finished event")
        stop.set()
        ours = [e for e in events if e.get("relocation") == rel["id"]]
        kinds = [e["kind"] for e in ours]
        assert kinds[0] == "relocation_started" and kinds[-1] == "relocation_finished", kinds
        assert [e["phase"] for e in ours if e["kind"] == "phase_started"] == list(rel["phases"])
        assert all(e["ok"] for e in ours if e["kind"] == "phase_ended") and kinds.count("phase_ended") == 8
        assert ours[-1]["result"] == "done" and ours[-1]["reason"] == "none"
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        log = Path(st["events"]["log"])
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [x["kind"] for x in lines if x.get("relocation") == rel["id"]] == kinds
    finally:
        stop.set()
        if t.is_alive():
            t.join(30)
        ctl.stop_worker(w["id"])
