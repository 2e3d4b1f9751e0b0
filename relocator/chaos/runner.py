"""`run_chaos`: forced relocations and injected faults under streaming load, checked.

The load (loadtests.run_load, greedy requests checked token by token against a reference taken
directly from a worker) runs on its own thread and event loop for the whole scenario. Moves run
one at a time; a fault is injected from outside the controller with the real mechanism, while
the runner watches the relocation's persisted phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from relocator.chaos import leaks as L
from relocator.chaos.budget import Stalled, Watch, guarded
from relocator.chaos.hosts import LocalView, host_view, split_faults
from relocator.procs import criu_processes, descendants, process_table
from relocator.chaos.faults import (FAULTS, SMOKE_FAULTS, Fault, Step, StepKind, check_outcome,
                                    check_scheduling_outcome, make_schedule, plan_fault_move)

MODEL = "tiny-llama"


@dataclass
class ChaosConfig:
    duration_s: float | None = None  # stop scheduling moves after this long (None: all moves)
    moves: int = 4  # plain forced moves (faults add one move each)
    suspends: int = 0  # suspend-then-resume steps
    make_rooms: int = 0  # make-room launches (a node-sized worker seated by the controller's moves)
    moves_per_minute: float = 0.0  # 0: back to back
    faults: list[str] = field(default_factory=list)
    streams: int = 4
    workers: int = 1
    gpus: int = 1
    output_tokens: tuple[int, ...] = (32, 96)
    seed: int = 0
    serve_target_s: float = 2.0
    move_timeout_s: float = 240.0
    png: str | None = None
    cluster_dir: str = "/var/lib/relocator/chaos"
    nodes: int = 3
    gpus_per_node: int = 4
    stop_workers: bool = True  # stop the workers it launched at the end
    engine: str | None = None  # the workers' engine (None: the default engine)
    # budgets (relocator/chaos/budget.py): a step (a move and what follows its fault) and the
    # whole run (None: an hour, plus `duration_s`); past one, the run ends `stalled`
    step_budget_s: float = 480.0
    run_budget_s: float | None = None

    @classmethod
    def smoke(cls, **kw: Any) -> "ChaosConfig":
        # 15 min: with the clean-up after a stall (a few minutes at most), inside the 20 min a
        # caller's `timeout 1200` gives it
        base = dict(moves=3, faults=list(SMOKE_FAULTS), streams=4, workers=1, run_budget_s=900.0)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)

    def run_budget(self) -> float:
        return self.run_budget_s if self.run_budget_s is not None else 3600.0 + (self.duration_s or 0.0)


# ---- small helpers -----------------------------------------------------------------------------
def _reference(lcfg: Any, endpoint: str, engine: str | None) -> Any:
    """Greedy outputs of the mix before any move, straight from a worker. A chat stream whose
    engine carries no token ids in it (SGLang: the router sends it as a completions stream on
    the engine's own rendering of the messages) is taken through the router instead, before
    any move; tests/test_sglang_adapter.py checks that path against the engine's own chat."""
    import dataclasses

    from adapters.base import DEFAULT_ENGINE, get_codec
    from loadtests import Reference, build_specs, make_reference

    codec = get_codec(engine or DEFAULT_ENGINE)
    specs = [s for s in build_specs(lcfg) if s.greedy]
    via_router = [s for s in specs if codec.translates(s.kind, s.body(MODEL))]
    direct = [s for s in specs if s not in via_router]
    ref = Reference()
    for part, url in ((direct, endpoint), (via_router, lcfg.url)):
        if part:  # (an empty `specs` means "the default mix")
            more = asyncio.run(make_reference(dataclasses.replace(lcfg, specs=part), url=url))
            ref.update(more)
            ref.text.update(more.text)
    return ref


def _chat_fraction(engine: str | None) -> float:
    """Half the streams are chat, unless the engine cannot continue a chat stream: chaos
    checks moves, not what an engine cannot do."""
    from adapters.base import DEFAULT_ENGINE, get_codec

    codec = get_codec(engine or DEFAULT_ENGINE)
    return 0.5 if codec.unsupported_reason("chat", {"messages": []}) is None else 0.0


def _post_ok(url: str, timeout: float = 5.0) -> bool:
    from relocator.router.auth import client_headers

    body = json.dumps({"model": MODEL, "prompt": "probe", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **client_headers()})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200 and b"choices" in r.read()
    except Exception:  # noqa: BLE001
        return False


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class _Probe:
    """Probes endpoints directly (max_tokens=1) on a thread and records when each answered."""

    SLOW_S = 1.0  # a probe answered later than this was sent to a worker that was not serving

    def __init__(self) -> None:
        self.endpoints: list[str] = []
        self.ok: dict[str, list[tuple[float, float | None]]] = {}  # endpoint -> [(sent, answered)]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def add(self, ep: str | None) -> None:
        if ep and ep not in self.endpoints:
            self.endpoints.append(ep)

    def _one(self, ep: str) -> None:
        def probe() -> None:
            t0 = time.time()
            ok = _post_ok(ep, timeout=5.0)
            self.ok.setdefault(ep, []).append((t0, time.time() if ok else None))

        while not self._stop.is_set():  # one new probe every 50 ms, not waiting for the last
            threading.Thread(target=probe, daemon=True).start()
            self._stop.wait(0.05)

    def _run(self) -> None:
        started: set[str] = set()
        while not self._stop.is_set():
            for ep in list(self.endpoints):
                if ep not in started:
                    started.add(ep)
                    threading.Thread(target=self._one, args=(ep,), daemon=True).start()
            self._stop.wait(0.02)

    def start(self) -> "_Probe":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def serving_at(self, ep: str, since: float, wait_s: float = 5.0) -> float | None:
        """When `ep` was serving again for good after `since`: the answer to the first prompt
        probe (within SLOW_S) sent after the last probe that failed or was slow."""
        return serving_again_at(self.answers(ep, since, wait_s), self.SLOW_S)

    def answers(self, ep: str, since: float, wait_s: float = 5.0) -> list[tuple[float, float | None]]:
        deadline = time.monotonic() + wait_s
        while True:
            xs = sorted(x for x in list(self.ok.get(ep, [])) if x[0] >= since - 0.05)
            if any(b is not None and b - a <= self.SLOW_S for a, b in xs) or time.monotonic() > deadline:
                return xs
            time.sleep(0.05)


def serving_again_at(probes: list[tuple[float, float | None]], slow_s: float = 1.0) -> float | None:
    """`probes`: (sent, answered or None), sorted by sent. The answer time of the first good
    probe (answered within `slow_s`) sent after the last bad one; None if none is good."""
    bad = [a for a, b in probes if b is None or b - a > slow_s]
    after = [b for a, b in probes if b is not None and b - a <= slow_s and (not bad or a > bad[-1])]
    return min(after) if after else None


# ---- the injector ---------------------------------------------------------------------------------
class Injector:
    """Acts on the real system when the relocation reaches the fault's phase."""

    def __init__(self, ctl: Any, base: Path, fault: Fault, worker: dict, view: LocalView | None = None) -> None:
        self.ctl, self.base, self.fault, self.worker = ctl, base, fault, worker
        self.view = view or LocalView(base)  # where a node's files are (emulated hosts: its own dirs)
        self.injected = False
        self.at: float | None = None  # wall time of the injection
        self.detail: dict[str, Any] = {}
        self._cleanups: list[Callable[[], Any]] = []  # undone once the move has ended

    def ready(self, rel: dict) -> bool:
        return rel.get("phase") == self.fault.phase and rel.get("result") == "running"

    def act(self, rel: dict, still: Callable[[], dict]) -> None:
        getattr(self, "_" + self.fault.name.replace("-", "_"))(rel, still)

    def _mark(self, **detail: Any) -> None:
        self.injected, self.at = True, time.time()
        self.detail.update(detail)

    def _agent_pid(self, node: str) -> int | None:
        import ray

        from relocator.agent import NAMESPACE, agent_name

        try:
            return ray.get(ray.get_actor(agent_name(node), namespace=NAMESPACE).ping.remote(), timeout=10)["pid"]
        except Exception:  # noqa: BLE001
            return None

    def _kill_agent(self, node: str, **detail: Any) -> None:
        import ray

        from relocator.agent import NAMESPACE, agent_name

        ray.kill(ray.get_actor(agent_name(node), namespace=NAMESPACE), no_restart=False)
        self._mark(killed_agent=node, **detail)

    def _kill_source_agent(self, rel: dict, still) -> None:
        rid = rel["id"]
        deadline = time.monotonic() + 5
        seen = False
        while time.monotonic() < deadline and not seen:  # CRIU dump in flight
            seen = bool(criu_processes(process_table(), "dump", rid))
            if not seen:
                time.sleep(0.01)
        if still().get("phase") != "DUMP":
            return
        self._kill_agent(rel["src"], criu_dump_running=seen)

    def _cut_transfer(self, rel: dict, still) -> None:
        """The target's page server, once the dump's pages flow into it."""
        rid = rel["id"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and still().get("phase") == "DUMP":
            for pid in criu_processes(process_table(), "page-server", rid):
                img = self.view.path(rel["dst"], rel.get("dst_image_dir") or "")
                got = sum(p.stat().st_size for p in img.glob("pages-*.img")) if img.is_dir() else 0
                if got > (8 << 20) and _kill(pid):
                    self._mark(killed="target page server", pid=pid, bytes_received=got)
                    return
            time.sleep(0.005)

    def _postcopy_session(self, rel: dict, still, timeout: float = 20.0) -> dict | None:
        """The post-copy state of the move's target copy once its keeper relays pages."""
        from relocator.agent.postcopy import read_state

        cdir = self.view.state_dir(rel["dst"]) / "cells" / rel["dst_cell"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and still().get("phase") == self.fault.phase:
            st = read_state(cdir) or {}
            if st.get("state") == "running" and st.get("page_bytes", 0) > 0:
                return st
            if st.get("state") in ("done", "failed"):
                return None
            time.sleep(0.01)
        return None

    def _postcopy_kill_target(self, rel: dict, still) -> None:
        st = self._postcopy_session(rel, still)
        cell_json = self.view.state_dir(rel["dst"]) / "cells" / rel["dst_cell"] / "cell.json"
        if st is None or not cell_json.exists():
            return
        init = json.loads(cell_json.read_text())["init_pid"]
        if _kill(int(init)):
            self._mark(killed="target copy during post-copy", pid=init, page_bytes=st.get("page_bytes"),
                       lazy_bytes=st.get("lazy_bytes"))

    def _postcopy_network_cut(self, rel: dict, still) -> None:
        st = self._postcopy_session(rel, still)
        pc = rel.get("postcopy") or {}
        port = pc.get("port")
        if st is None or not port:
            return
        tag = f"relocator-chaos-{rel['id']}"
        # a cut link cuts both of the source's connections: the page server's and the push's
        rules, cut = [], []
        for p in (port, pc.get("pump_port")):
            if not p:
                continue
            # exactly that connection (its peer port from ss): a rule on the port alone also drops
            # any other loopback connection that happens to get it as its ephemeral port
            out = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{p} )"],
                                 capture_output=True, text=True).stdout.split()
            ports = [a.rsplit(":", 1)[1] for a in out if ":" in a and a.rsplit(":", 1)[1].isdigit()]
            peer = next((x for x in ports if x != str(p)), None)
            if peer is None:
                continue
            rules += [["-p", "tcp", "--dport", str(p), "--sport", peer], ["-p", "tcp", "--sport", str(p), "--dport", peer]]
            cut.append(f"tcp {p} <-> {peer}")
        if not cut or not cut[0].startswith(f"tcp {port} "):
            return  # the page server's connection is gone already (the post-copy ended)
        for r in rules:
            subprocess.run(["iptables", "-I", "INPUT", *r, "-m", "comment", "--comment", tag, "-j", "DROP"],
                           check=True, capture_output=True)
        self._cleanups.append(lambda: [subprocess.run(
            ["iptables", "-D", "INPUT", *r, "-m", "comment", "--comment", tag, "-j", "DROP"], capture_output=True)
            for r in rules])
        self._mark(cut=", ".join(cut) + " (the source's page server and push, and the keeper)",
                   page_bytes=st.get("page_bytes"), lazy_bytes=st.get("lazy_bytes"))

    def _postcopy_source_loss(self, rel: dict, still) -> None:
        import ray

        st = self._postcopy_session(rel, still)
        if st is None:
            return
        node = rel["src"]
        # the node's page server first (it dies with the node), then the node itself
        dumps = criu_processes(process_table(), "dump", "--lazy-pages", rel["id"])
        for pid in dumps:
            _kill(pid)
        ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and f"relocator_node:{node}" in n.get("Resources", {})]
        for pid, (_, argv) in process_table().items():
            if ids and argv and "raylet" in argv[0] and any(f"--node_id={ids[0]}" in a for a in argv):
                _kill(pid)
                self._mark(node=node, raylet_pid=pid, lazy_dumps=dumps, page_bytes=st.get("page_bytes"),
                           lazy_bytes=st.get("lazy_bytes"))
                return

    def cleanup(self) -> None:
        for fn in self._cleanups:
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass
        self._cleanups.clear()

    def _flip_byte(self, rel: dict, still) -> None:
        img = (self.view.path(rel["dst"], rel["dst_image_dir"]) if rel.get("dst_image_dir")
               else self.view.path(rel["src"], rel["image_dir"]))
        files = [p for p in img.iterdir() if p.is_file() and p.name.endswith(".img")]
        if not files:
            return
        big = max(files, key=lambda p: p.stat().st_size)
        off = big.stat().st_size // 2
        with open(big, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0xFF]))
        self._mark(file=str(big), offset=off)

    def _kill_target_cell(self, rel: dict, still) -> None:
        rid, dst_cell = rel["id"], rel.get("dst_cell")
        cell_json = self.view.state_dir(rel["dst"]) / "cells" / dst_cell / "cell.json"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            table = process_table()
            for pid in criu_processes(table, "restore", rid):
                kids = descendants(pid, table)
                if kids:
                    for k in kids:
                        _kill(k)
                    self._mark(killed="tasks under criu restore", pids=kids)
                    return
            if cell_json.exists():
                try:
                    init = json.loads(cell_json.read_text())["init_pid"]
                except (OSError, ValueError, KeyError):
                    init = None
                if init and still().get("phase") == "RESTORE" and _kill(int(init)):
                    self._mark(killed="restored cell init", pids=[init])
                    return
            if still().get("phase") != "RESTORE":
                return
            time.sleep(0.005)

    def _kill_controller(self, rel: dict, still) -> None:
        import ray

        from relocator.agent import NAMESPACE
        from relocator.controller.controller import CONTROLLER_NAME

        h = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        pid = ray.get(h.ping.remote(), timeout=10)["pid"]
        if still().get("phase") != self.fault.phase:
            return
        _kill(pid)
        self._mark(controller_pid=pid)

    _kill_controller_switch = _kill_controller

    def _restart_router(self, rel: dict, still) -> None:
        from loadtests.abuse import listener_pid
        from relocator.cluster.local import read_info

        # the daemon records the router it runs (it also holds the listening socket itself)
        pid = (read_info(self.base) or {}).get("router_pid") or listener_pid(int(self.ctl.router_url.rsplit(":", 1)[1]))
        if pid and _kill(pid, signal.SIGTERM):
            self._mark(router_pid=pid)

    def _node_loss(self, rel: dict, still) -> None:
        import ray

        node = rel["dst"]
        if self.view.emulated:  # the whole host dies: raylet, agent, cells
            target_ns = [f"rl-{rel['dst_cell']}"] if rel.get("dst_cell") else []
            killed = self.view.kill_node(node, netns=target_ns) or {}
            self._mark(node=node, host_pids=len(killed.get("pids", [])), cells=killed.get("cells"))
            return
        ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and f"relocator_node:{node}" in n.get("Resources", {})]
        if not ids:
            return
        for pid, (_, argv) in process_table().items():
            if argv and "raylet" in argv[0] and any(f"--node_id={ids[0]}" in a for a in argv):
                _kill(pid)
                self._mark(node=node, raylet_pid=pid)
                return


# ---- the run --------------------------------------------------------------------------------------
class _LoadThread:
    def __init__(self, cfg) -> None:
        from loadtests import run_load

        self.loop = asyncio.new_event_loop()
        self.stop_ev: asyncio.Event | None = None
        self.report = None
        self.error: BaseException | None = None

        async def main():
            self.stop_ev = asyncio.Event()
            return await run_load(cfg, stop=self.stop_ev)

        def body():
            try:
                self.report = self.loop.run_until_complete(main())
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

        self.t = threading.Thread(target=body, daemon=True)

    def start(self) -> "_LoadThread":
        self.t.start()
        return self

    def stop(self, timeout: float = 300) -> Any:
        while self.stop_ev is None and self.t.is_alive():
            time.sleep(0.05)
        if self.stop_ev is not None:
            self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.t.join(timeout)
        if self.error:
            raise self.error
        return self.report


#: the budgets of the run whose steps this thread runs (run_chaos's step thread sets it): the
#: poll helpers check it, so a step thread the run gave up on stops at its next poll
_LOCAL = threading.local()


def _watch() -> Watch | None:
    return getattr(_LOCAL, "watch", None)


def _check() -> None:
    if (w := _watch()) is not None:
        w.check()


def _seen(event: str) -> None:
    if (w := _watch()) is not None:
        w.seen(event)


def _waiting(what: str) -> None:
    if (w := _watch()) is not None:
        w.waiting(what)


def _last_controller_event(view: LocalView, log: str | None) -> dict | None:
    """The last line of the controller's events.jsonl, read from disk (the controller may be
    gone); on emulated hosts from whichever host's directory has it."""
    if not log:
        return None
    for host in sorted(getattr(view, "hosts", {})) or [""]:
        p = view.path(host, log)
        try:
            with open(p, "rb") as fh:
                fh.seek(max(0, p.stat().st_size - 16384))
                lines = [ln for ln in fh.read().splitlines() if ln.strip()]
            return json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):
            continue
    return None


def _rel(ctl, rid: str) -> dict:
    while True:
        _check()
        try:
            rel = ctl.get_relocation(rid) or {}
        except Exception:  # noqa: BLE001 - the controller is restarting
            time.sleep(0.1)
            continue
        _seen(f"relocation {rid}: {rel.get('phase')} ({rel.get('result')})")
        return rel


def _status(ctl, tries: int = 600) -> dict:
    for _ in range(tries):
        _check()
        try:
            return ctl.status()
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    return ctl.status()


def _detected_at(rel: dict, inj: Injector | None, lost_at: float | None = None) -> float | None:
    """Fault detection: the injection itself for a dead controller or router (Ray and the
    daemon notice at once), else the end of the first failed phase or the controller seeing
    the node lost (`lost_at`), whichever came first, else the injection."""
    if inj and inj.injected and inj.fault.name in ("kill-controller", "kill-controller-switch", "restart-router"):
        return inj.at
    seen = [float(p["ended"]) for p in rel.get("phases", []) if p.get("ok") is False and p.get("ended")]
    seen += [lost_at] if lost_at else []
    if seen:
        return min(seen)
    return inj.at if inj and inj.injected else None


def _freeze_end(rel: dict) -> float | None:
    """When the move stopped freezing its worker: the end of SWITCH, or of the relocation."""
    ends = [p["ended"] for p in rel.get("phases", []) if p.get("name") == "SWITCH" and p.get("ended")]
    return float(ends[-1]) if ends else rel.get("finished_at")


def one_move(ctl, base: Path, step: Step, worker: dict, dst: str, cfg: ChaosConfig, say,
             view: LocalView | None = None) -> dict[str, Any]:
    fault = FAULTS[step.fault] if step.fault else None
    t_start = time.time()
    s = ctl.relocate(worker["id"], to=dst, transfer=fault.transfer if fault else None,
                     faults=fault.relocate_faults() if fault else None, wait=False)
    rid = s["id"]
    inj = Injector(ctl, base, fault, worker, view) if fault else None
    # probes go to the worker directly, so they start only once the fault is detected: a
    # connection waiting in the accept queue while CRIU dumps makes the dump fail
    probe = _Probe().start() if fault else None
    state: dict[str, Any] = {}

    def still() -> dict:
        state["rel"] = _rel(ctl, rid)
        return state["rel"]

    deadline = time.monotonic() + cfg.move_timeout_s
    _waiting(f"relocation {rid} of {worker['id']} ({step.fault or 'plain move'}) to finish")
    rel = still()
    while rel.get("result") == "running" and time.monotonic() < deadline:
        if inj and not inj.injected and inj.ready(rel):
            try:
                inj.act(rel, still)
            except Exception as exc:  # noqa: BLE001
                inj.detail["error"] = f"{type(exc).__name__}: {exc}"
            if not inj.injected:
                inj.fault_missed = True
        # right after the injection too: the next status poll may wait on a restarting controller
        if probe and _detected_at(rel, inj) is not None:
            probe.add(worker["endpoint"])
            probe.add(rel.get("dst_endpoint"))
        time.sleep(0.02)
        rel = still()
    if inj:
        inj.cleanup()
    timed_out = rel.get("result") == "running"
    node_alive = True
    lost_at = None
    if fault and fault.destructive:
        # Ray declares the node dead after its health checks fail; a worker that ended up there
        # (the move completed first) is then marked lost and replaced (from its last image)
        t_end = time.monotonic() + cfg.move_timeout_s
        _waiting(f"Ray to declare {rel.get(fault.lost_node)} dead and {worker['id']} running or failed on a live node")
        while time.monotonic() < t_end:
            st = _status(ctl)
            nodes = {n["id"]: n for n in st["nodes"]}
            w = next((x for x in st["workers"] if x["id"] == worker["id"]), None)
            if w:
                _seen(f"{w['id']}: {w['state']} on {w['node']}")
            node_alive = bool(w) and nodes.get(w["node"], {}).get("alive", False)
            lost_at = nodes.get(rel.get(fault.lost_node), {}).get("lost_at")
            if probe and w and w.get("endpoint"):
                probe.add(w["endpoint"])
            if lost_at and node_alive and w["state"] in ("running", "failed"):
                break
            time.sleep(0.2)
    # serving again: a probe to the worker's endpoint now, answered
    st = _status(ctl)
    w = next((x for x in st["workers"] if x["id"] == worker["id"]), None)
    ep = w["endpoint"] if w else None
    serving = False
    serve_again = None
    if probe:
        probe.add(worker["endpoint"])
        probe.add(rel.get("dst_endpoint"))
    if w and w["state"] == "running":
        _waiting(f"{w['id']} to answer at {ep}")
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and not serving:
            _check()
            serving = _post_ok(ep, timeout=5)
            if not serving:
                time.sleep(0.2)
    if probe:
        det = _detected_at(rel, inj, lost_at)
        if det is not None and fault.spares_worker:
            # the worker is frozen by the move itself until SWITCH (or the rollback): that
            # blackout is the relocation's, not the fault's; count from its end
            det = max(det, _freeze_end(rel) or det)
        if det is not None and ep:
            at = probe.serving_at(ep, det)
            # never negative: a source that kept serving (its dump was cut short) counts as 0
            serve_again = round(max(0.0, at - det), 3) if at else None
        probe.stop()
    settle_s = _settle(ctl)
    out = {"step": step.index, "fault": step.fault, "relocation": rid, "worker": worker["id"],
           "from": rel.get("src"), "to": dst, "result": "timeout" if timed_out else rel.get("result"),
           "error": (rel.get("error") or "")[:300], "recovered": rel.get("recovered"),
           "phases": {p["name"]: round(p["ended"] - p["started"], 3) for p in rel.get("phases", []) if p.get("ended")},
           "phase_times": [(p["name"], p["started"], p["ended"]) for p in rel.get("phases", []) if p.get("ended")],
           "rollback": rel.get("rollback") or {}, "started_at": t_start, "ended_at": time.time(),
           "worker_after": {k: w.get(k) for k in ("node", "state", "cell", "endpoint")} if w else None,
           "serving": serving, "worker_node_alive": node_alive, "settle_s": settle_s}
    if inj:
        out.update(injected=inj.injected, injected_at=inj.at, detected_at=_detected_at(rel, inj, lost_at),
                   serve_again_s=serve_again, source_serving_s=(rel.get("rollback") or {}).get("source_serving_s"),
                   detail=inj.detail)
    say(f"  move {step.index}: {worker['id']} {rel.get('src')}→{dst} {step.fault or 'plain'}: {out['result']}"
        + (f", serving again {serve_again}s" if serve_again is not None else "")
        + ("" if serving else " NOT SERVING"))
    return out


def _serving(ctl, ids: list[str] | None = None, timeout: float = 30.0) -> list[str]:
    """The workers (`ids`, default all) that are not running or do not answer within `timeout`."""
    st = _status(ctl)
    bad = []
    for w in st["workers"]:
        if ids is not None and w["id"] not in ids:
            continue
        t_end = time.monotonic() + timeout
        ok = False
        while time.monotonic() < t_end and not ok:
            ok = w["state"] == "running" and bool(w.get("endpoint")) and _post_ok(w["endpoint"], timeout=5)
            if not ok:
                time.sleep(0.3)
                w = next((x for x in _status(ctl)["workers"] if x["id"] == w["id"]), w)
        if not ok:
            bad.append(w["id"])
    return bad


def suspend_resume(ctl, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say) -> dict[str, Any]:
    """Suspend the worker (image to the store, GPUs released, its streams held or sent to a
    sibling) and resume it wherever the controller seats it; then it must serve."""
    out: dict[str, Any] = {"step": step.index, "kind": StepKind.SUSPEND_RESUME.value, "fault": step.fault,
                           "worker": worker["id"], "from": worker["node"], "started_at": time.time(),
                           "suspended": False, "resumed": False, "cells": [worker["cell"]]}
    try:
        s = ctl.suspend(worker["id"])
        out.update(suspended=True, suspend_s=s.get("seconds"), image_bytes=s.get("image_bytes"),
                   sibling=s.get("sibling"))
        r = ctl.resume(worker["id"])
        out.update(resumed=r.get("state") == "running", resume_s=r.get("seconds"), to=r.get("node"),
                   result="done" if r.get("state") == "running" else r.get("state"))
        if r.get("cell_id"):
            out["cells"].append(r["cell_id"])
    except Exception as exc:  # noqa: BLE001 - checked below
        out.update(error=f"{type(exc).__name__}: {exc}", result="failed")
    out["not_serving"] = _serving(ctl, [worker["id"]])
    out["serving"] = not out["not_serving"]
    out["ended_at"] = time.time()
    out["settle_s"] = _settle(ctl)
    say(f"  step {step.index}: suspend+resume {worker['id']} {out['from']}→{out.get('to')}: {out['result']}"
        + ("" if out["serving"] else " NOT SERVING"))
    return out


def _fragment(ctl, gpus: int, tag: str) -> list[Any]:
    """1-GPU placeholders (another tenant's reservations, never moved) on every node with all
    its GPUs free, so that no node has `gpus` free GPUs and a launch of that size needs moves."""
    import ray
    from ray.util import placement_group

    # Ray frees a stopped worker's reservation asynchronously (seen lagging seconds on a loaded
    # machine): wait until its view agrees with the records, or a node that is about to be free
    # gets no filler and the launch needs no move
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = _status(ctl)
        held: dict[str, int] = {}
        for w in st["workers"]:
            if w.get("state") in ("running", "starting", "relocating"):
                held[w["node"]] = held.get(w["node"], 0) + int(w.get("gpus") or 0)
        if all(n["gpus_free"] == n["gpus_total"] - held.get(n["id"], 0) for n in st["nodes"]
               if n.get("alive", True)):
            break
        time.sleep(0.5)
    pgs = []
    for n in _status(ctl)["nodes"]:
        if n.get("alive", True) and n["gpus_free"] >= gpus:
            pg = placement_group([{"GPU": 1.0, f"relocator_node:{n['id']}": 0.001}], strategy="STRICT_PACK",
                                 name=f"chaos-filler-{tag}-{n['id']}")
            ray.get(pg.ready(), timeout=60)
            pgs.append(pg)
    return pgs


def make_room(ctl, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say) -> dict[str, Any]:
    """A fragmented cluster (no node with all its GPUs free) and a launch of a node-sized
    worker: the controller's live moves seat it. With the step's fault, the first move fails:
    the plan stops, the demand stays pending, every worker serves; the demand is then dropped."""
    import ray

    fault = FAULTS[step.fault] if step.fault else None
    gpus = cfg.gpus_per_node
    out: dict[str, Any] = {"step": step.index, "kind": StepKind.MAKE_ROOM.value, "fault": step.fault,
                           "worker": f"mr{step.index}", "gpus": gpus, "started_at": time.time(), "moves": [],
                           "cells": []}
    pgs = _fragment(ctl, gpus, str(step.index))
    launched = None
    try:
        plan = ctl.launch(MODEL, gpus, worker_id=out["worker"], engine=cfg.engine, dry_run=True)["plan"]
        out["plan"] = plan
        if plan["how"] != "make_room":
            out.update(result="skipped", error=f"no make-room plan for {gpus} GPU(s): {plan['how']} {plan['reason']}")
            return out
        t = time.monotonic()
        res = ctl.launch(MODEL, gpus, worker_id=out["worker"], engine=cfg.engine,
                         faults=fault.relocate_faults() if fault else None)
        out["launch_s"] = round(time.monotonic() - t, 3)
        out["launch_state"] = res.get("state")
        out["demand_pending"] = any(d["id"] == out["worker"] for d in ctl.pending())
        launched = out["worker"]
        if res.get("cell_id"):
            out["cells"].append(res["cell_id"])
        mine = {m["worker"] for m in plan["moves"]}
        rels = [r for r in _status(ctl)["relocations"] if r["worker"] in mine and r["created_at"] >= out["started_at"]]
        out["moves"] = [{"relocation": r["id"], "worker": r["worker"], "from": r["from"], "to": r["to"],
                         "result": r["result"], "error": (r.get("error") or "")[:200]} for r in rels]
        out["relocations"] = [r["id"] for r in rels]
        if fault:  # the controller injects it into the plan's first move
            out["injected"], out["injected_at"] = bool(rels), min((r["created_at"] for r in rels), default=None)
            # the moved worker serving again after the failure: what its rollback measured
            rb = next(((r.get("rollback") or {}) for r in rels if r["result"] != "done"), {})
            out["serve_again_s"] = out["source_serving_s"] = rb.get("source_serving_s")
        out["result"] = ("done" if res.get("state") == "running" else res.get("state"))
    except Exception as exc:  # noqa: BLE001 - checked below
        out.update(error=f"{type(exc).__name__}: {exc}", result="failed")
    finally:
        for pg in pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
    out["not_serving"] = _serving(ctl, [w["id"] for w in _status(ctl)["workers"] if w["id"] != out["worker"]])
    out["serving"] = not out["not_serving"]
    if launched:  # the node-sized worker (or its pending demand) goes again
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            try:
                ctl.stop_worker(launched)
                break
            except KeyError:
                break
            except RuntimeError:  # being seated by the reconcile loop's retry: once it is done
                time.sleep(1.0)
    out["ended_at"] = time.time()
    out["settle_s"] = _settle(ctl)
    say(f"  step {step.index}: make-room launch of {gpus} GPU(s) {step.fault or 'plain'}: {out['result']} "
        f"(moves {[m['result'] for m in out['moves']]})" + ("" if out["serving"] else " NOT SERVING"))
    return out


def _settle(ctl, timeout: float = 60.0) -> float | None:
    """Until the router answers a request again (it may be restarting, or re-registering the
    workers): the next move starts on a serving cluster. Seconds waited, None if it never did."""
    t0 = time.monotonic()
    _waiting("the router to answer")
    while time.monotonic() - t0 < timeout:
        _check()
        if _post_ok(ctl.router_url, timeout=10):
            return round(time.monotonic() - t0, 3)
        time.sleep(0.2)
    return None


def _leak_settle(view: LocalView, before: dict, expected: dict, netns_names: set[str],
                 timeout: float = 20.0) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        leaked = L.diff_leaks(before, view.collect(netns_names=netns_names), expected)
        if not L.total(leaked) or time.monotonic() > deadline:
            return leaked
        time.sleep(1.0)


def _our_netns(cells: set[str], moves: list[dict]) -> set[str]:
    """The namespaces this run's cells can have: rl-<cell> of every cell it saw (launches,
    replacements) and rl-<worker>-<relocation> of every relocation target."""
    names = {f"rl-{c}" for c in cells}
    names |= {f"rl-{m['worker']}-{m['relocation']}" for m in moves if m.get("relocation")}
    names |= {f"rl-{r['worker']}-{r['relocation']}" for m in moves for r in m.get("moves", [])
              if isinstance(r, dict) and r.get("relocation")}
    return names


def _expected(st: dict, moves: list[dict]) -> dict[str, set[str]]:
    """What must exist now: each worker's cell and netns, its reservation and its newest image
    (kept for a warm restart)."""
    cells = {f"{w['node']}/{w['cell']}" for w in st["workers"]}
    pgs = {w["reservation"] for w in st["workers"] if w.get("reservation")}
    images = {f"{Path(w['last_image']).parent.parent.name}/{Path(w['last_image']).name}"
              for w in st["workers"] if w.get("last_image")}
    return {"cells": cells, "netns": {"rl-" + w["cell"] for w in st["workers"]}, "placement_groups": pgs,
            "images": images}


CONTROLLER_SPARED = ("hosts the controller, which is pinned there (the head node, or deploy's controller.node) "
                     "and does not survive its loss: a fault that kills a node never takes it")


def _own_node_id(_actor: Any) -> str:
    """Run inside an actor (`__ray_call__`): the Ray node id it runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _controller_ray_node(ctl: Any) -> str | None:
    """The Ray node id the controller actor runs on, asked of the actor itself."""
    import ray

    try:
        return ray.get(ctl.handle.__ray_call__.remote(_own_node_id), timeout=30)
    except Exception:  # noqa: BLE001 - a fake client, or the controller restarting
        return None


def _head_ray_node() -> str | None:
    import ray

    return next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                 and "node:__internal_head__" in n.get("Resources", {})), None)


def spared_nodes(st: dict, controller_ray_node: str | None, head_ray_node: str | None,
                 protected: set[str]) -> dict[str, str]:
    """{node: why} for the nodes a node-killing fault must spare: the controller's (from its
    actor; else the head's, where it is pinned), and the view's protected ones."""
    by_ray = {n.get("ray_node_id"): n["id"] for n in st["nodes"]}
    out = {p: "emulated hosts: the head (GCS) or the controller's host" for p in sorted(protected)}
    if controller_ray_node in by_ray:
        out[by_ray[controller_ray_node]] = CONTROLLER_SPARED
    elif head_ray_node in by_ray:
        out[by_ray[head_ray_node]] = CONTROLLER_SPARED + " (its node not known: the head's spared)"
    return out


def _fault_step(ctl, base: Path, step: Step, w: dict, cfg: ChaosConfig, say, view: LocalView,
                spared: dict[str, str], rng: random.Random) -> list[dict[str, Any]]:
    """One forced move (with its fault): to a target that spares `spared`, after a plain move
    off a spared node when the fault takes the move's source."""
    fault = FAULTS[step.fault] if step.fault else None
    out: list[dict[str, Any]] = []
    for _ in range(2):
        st = _status(ctl)
        w = next(x for x in st["workers"] if x["id"] == w["id"])
        alive = [n["id"] for n in st["nodes"] if n.get("alive", True)]
        free = {n["id"]: n["gpus_free"] for n in st["nodes"]}
        fm = plan_fault_move(fault, w["node"], w["gpus"], free, alive, sorted(spared), step.dst, rng)
        if fm.dst is None:
            return out + [{"step": step.index, "fault": step.fault, "result": "skipped", "error": fm.why}]
        if not fm.pre:
            return out + [one_move(ctl, base, step, w, fm.dst, cfg, say, view)]
        say(f"  step {step.index}: {w['id']} moved off spared {w['node']} first ({step.fault} takes its source)")
        pre = one_move(ctl, base, Step(step.index, w["id"], fm.pre), w, fm.pre, cfg, say, view)
        out.append({**pre, "setup_for": step.fault, "spared": w["node"]})
        if pre.get("result") != "done":
            return out + [{"step": step.index, "fault": step.fault, "result": "skipped",
                           "error": f"could not move {w['id']} off spared {w['node']}: {pre.get('result')}"}]
    return out + [{"step": step.index, "fault": step.fault, "result": "skipped",
                   "error": f"{w['id']} still on a spared node"}]


def run_chaos(cfg: ChaosConfig, ctl: Any = None, say: Callable[[str], None] = lambda *_: None) -> dict[str, Any]:
    from loadtests import LoadConfig, check_tokens, make_reference

    own = ctl is None
    t_all = time.monotonic()
    watch = Watch(cfg.run_budget(), cfg.step_budget_s)
    if own:
        import relocator
        from relocator.cluster.local import read_info

        info = read_info(cfg.cluster_dir)
        if info and info.get("address"):
            ctl, own = relocator.connect(cfg.cluster_dir), False
        else:
            say(f"starting a {cfg.nodes}-node cluster in {cfg.cluster_dir}")
            ctl = relocator.start(nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, base_dir=cfg.cluster_dir)
    base = Path(ctl.info["base_dir"])
    view = host_view(ctl, base)
    # faults that cannot apply on this cluster (emulated hosts) are skipped, each with its reason
    kept, skipped = split_faults(cfg.faults, view)
    if skipped:
        import dataclasses

        cfg = dataclasses.replace(cfg, faults=kept)
        for f, why in skipped.items():
            say(f"skipping {f}: {why}")
    rng = random.Random(cfg.seed)
    report: dict[str, Any] = {"config": asdict(cfg), "cluster": "emulated hosts" if view.emulated else "local",
                              "skipped_faults": skipped}
    launched: list[str] = []
    seen_cells: set[str] = set()  # every cell of our workers this run saw (for the netns check)
    load = None
    before: dict = {}
    moves: list[dict] = []  # (outside the step thread: a stalled run reports the moves it made)

    def body() -> None:
        nonlocal load, before
        _LOCAL.watch = watch
        watch.phase("launch")
        before = view.collect()
        st0 = ctl.status()
        report["events_log"] = (st0.get("events") or {}).get("log")
        t = time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(cfg.workers) as pool:
            ws = list(pool.map(lambda _: ctl.launch(MODEL, gpus=cfg.gpus, engine=cfg.engine),
                               range(cfg.workers)))
        launched.extend(w["id"] for w in ws)
        seen_cells.update(w["cell_id"] for w in ws)
        report["launch_s"] = round(time.monotonic() - t, 3)
        say(f"launched {', '.join(w['id'] + '@' + w['node'] for w in ws)} ({report['launch_s']:.0f}s)")
        lcfg = LoadConfig(url=ctl.router_url, model=MODEL, concurrency=cfg.streams, duration_s=1e9,
                          output_tokens=list(cfg.output_tokens), prompt_words=[8, 32], distinct=12,
                          greedy_fraction=0.75, seed=cfg.seed, request_timeout_s=300,
                          chat_fraction=_chat_fraction(cfg.engine))
        watch.waiting("the greedy reference from the worker")
        ref = _reference(lcfg, ws[0]["endpoint"], cfg.engine)
        load = _LoadThread(lcfg).start()
        time.sleep(1.0)
        nodes = [n["id"] for n in st0["nodes"]]
        steps = make_schedule(cfg.moves, cfg.faults, {w["id"]: w["node"] for w in ws}, nodes, cfg.seed,
                              suspends=cfg.suspends, make_rooms=cfg.make_rooms)
        say(f"{len(steps)} steps ({cfg.moves} plain moves, {cfg.suspends} suspend+resume, {cfg.make_rooms} "
            f"make-room, faults: {', '.join(cfg.faults) or 'none'}), {cfg.streams} streams")
        interval = 60.0 / cfg.moves_per_minute if cfg.moves_per_minute > 0 else 0.0
        t_moves = time.monotonic()
        for i, step in enumerate(steps):
            if cfg.duration_s and time.monotonic() - t_moves > cfg.duration_s:
                say(f"duration reached after {i} moves")
                break
            if interval:
                wait = t_moves + i * interval - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            watch.begin(f"step {i} ({step.fault or step.kind.value})", step.fault)
            st = _status(ctl)
            w = next(x for x in st["workers"] if x["id"] == step.worker)
            if step.kind is not StepKind.MOVE:  # the scheduling layer's steps
                if step.kind is StepKind.SUSPEND_RESUME and w["state"] != "running":
                    moves.append({"step": i, "kind": step.kind.value, "fault": step.fault, "result": "skipped",
                                  "error": f"worker {w['id']} is {w['state']}"})
                    continue
                m = SCHEDULING_STEPS[step.kind](ctl, base, step, w, cfg, say)
                seen_cells.update(m.get("cells", []))
                moves.append(m)
                continue
            if w["state"] != "running":
                moves.append({"step": i, "fault": step.fault, "result": "skipped",
                              "error": f"worker {w['id']} is {w['state']}"})
                continue
            spared: dict[str, str] = {}
            if step.fault and FAULTS[step.fault].destructive:  # where the controller is now
                spared = spared_nodes(st, _controller_ray_node(ctl), _head_ray_node(), view.protected)
                report.setdefault("spared_nodes", {}).update(spared)
            moves.extend(_fault_step(ctl, base, step, w, cfg, say, view, spared, rng))
        watch.phase("checks after the steps")
        time.sleep(1.0)
        watch.waiting("the load's streams to end")
        rep = load.stop()
        load = None
        watch.waiting("the cluster's status and the leak check")
        tc = check_tokens(rep, ref)
        summ = rep.summary()
        # failed requests, attributed to the fault whose window (injection .. move end + 2 s) holds them
        windows = [(m["fault"], m.get("injected_at") or m["started_at"], m["ended_at"] + 2.0)
                   for m in moves if m.get("fault") and m.get("started_at")]
        by_fault: dict[str, int] = {}
        failed = []
        for r in rep.results:
            if r.ok:
                continue
            end = rep.started_at + r.start + (r.total or 0)
            f = next((f for f, a, b in windows if a - 0.5 <= end <= b), None)
            by_fault[f or "none"] = by_fault.get(f or "none", 0) + 1
            failed.append({"index": r.index, "error": r.error, "fault": f})
        # the same check without the requests a router restart cut (a closed-loop client without
        # retries fails fast while the router is down: thousands of failed requests, each of
        # which counts its whole reference as lost)
        cut = {r["index"] for r in failed if r["fault"] and FAULTS[r["fault"]].requests_may_fail}
        from loadtests import LoadReport

        rest = LoadReport(config=rep.config, started_at=rep.started_at, duration_s=rep.duration_s,
                          results=[r for r in rep.results if r.index not in cut])
        tc_rest = check_tokens(rest, ref)
        rep.token_check = tc
        st = _status(ctl)
        seen_cells.update(w["cell"] for w in st["workers"] if w["id"] in launched)
        leaked_mid = _leak_settle(view, before, _expected(st, moves), _our_netns(seen_cells, moves))
        outcomes = []
        scheduling: list[dict] = []
        for m in moves:
            if m.get("result") == "skipped":
                outcomes.append({"fault": m["fault"], "result": "skipped", "ok": False, "problems": [m["error"]]})
                if m.get("kind") not in (None, StepKind.MOVE):
                    scheduling.append({**outcomes[-1], "kind": m["kind"], "step": m["step"]})
                continue
            f = FAULTS[m["fault"]] if m.get("fault") else None
            if m.get("kind") not in (None, StepKind.MOVE):
                o = check_scheduling_outcome({**m, "failed_requests": by_fault.get(m.get("fault") or "", 0)
                                              if f else 0}, f)
                outcomes.append({**o.to_dict(), "step": m["step"], "kind": m["kind"],
                                 "serve_again_s": m.get("serve_again_s"), "injected": m.get("injected"),
                                 "source_serving_s": m.get("source_serving_s")})
                scheduling.append(outcomes[-1])
                continue
            o = check_outcome(f, m, injected=m.get("injected", True), serving=m["serving"],
                              worker_node_alive=m.get("worker_node_alive", True),
                              serve_again_s=m.get("serve_again_s"), failed_requests=by_fault.get(m.get("fault") or "", 0)
                              if f else 0, leaked=None,
                              serve_target_s=(f.serve_target_s if f and f.serve_target_s else cfg.serve_target_s))
            outcomes.append({**o.to_dict(), "step": m["step"], "serve_again_s": m.get("serve_again_s"),
                             "source_serving_s": m.get("source_serving_s"), "injected": m.get("injected"),
                             "detail": m.get("detail")})
        # one shaded span per move: DUMP start .. SWITCH end (the worker frozen, its streams
        # held), labelled when there are few; each injection marked with the fault's name
        phases = []
        for m in moves:
            pt = [(n, a, b) for n, a, b in m.get("phase_times", []) if n in ("DUMP", "TRANSFER", "RESTORE", "SWITCH")]
            if pt:
                label = f"{m['step']}:{'DUMP..SWITCH' if pt[-1][0] == 'SWITCH' else pt[-1][0]}" if len(moves) <= 15 else ""
                phases.append((label, pt[0][1], pt[-1][2]))
        phases += [(f"{m['step']}:{m['fault']}", m["injected_at"], m["injected_at"] + 0.05)
                   for m in moves if m.get("injected_at")]
        if cfg.png:
            rep.write_png(cfg.png, phases=phases)
        plain = [m for m in moves if not m.get("fault") and m.get("kind") in (None, StepKind.MOVE)]
        report.update({
            "relocations": len([m for m in moves if m.get("result") not in ("skipped", None)]),
            "relocations_done": sum(m.get("result") == "done" for m in moves),
            "plain_moves": len(plain), "plain_moves_done": sum(m.get("result") == "done" for m in plain),
            "faults_injected": sum(bool(m.get("injected")) for m in moves),
            "failed_requests": summ["failed_requests"], "failed_requests_by_fault": by_fault,
            "requests": summ["requests"], "failed_by_error": summ["errors"], "tokens": summ["tokens"],
            "tokens_checked_requests": tc.checked,
            "tokens_lost": tc.tokens_lost, "tokens_duplicated": tc.tokens_duplicated,
            "tokens_mismatched": tc.tokens_mismatched, "token_bad": tc.bad[:5],
            "texts_checked_requests": tc.texts_checked, "text_mismatched": tc.text_mismatched,
            "text_bad": tc.text_bad[:5],
            "excluding_router_restart": {"requests": len(rest.results), "failed_requests": len(failed) - len(cut),
                                         "tokens_lost": tc_rest.tokens_lost,
                                         "tokens_duplicated": tc_rest.tokens_duplicated,
                                         "tokens_mismatched": tc_rest.tokens_mismatched,
                                         "text_mismatched": tc_rest.text_mismatched},
            "itl_ms": summ["itl_ms"], "ttft_ms": summ["ttft_ms"],
            "leaked": leaked_mid, "faults": {o["fault"]: o for o in outcomes if o.get("fault")},
            "moves": moves, "failed": failed[:20],
            "scheduling_steps": scheduling,
            "phase_seconds_p50": _p50_phases(moves),
        })

    stalled: dict[str, Any] | None = None
    try:
        stalled = guarded(body, watch)
        if stalled:
            stalled["controller_event"] = _last_controller_event(view, report.get("events_log"))
            report.update(stalled=stalled, moves=moves)
            say(f"STALLED in {stalled['step']} after {stalled['elapsed_s']}s (the {stalled['budget']}'s budget, "
                f"{stalled['budget_s']:g}s): waiting for {stalled['waiting_for']}; last seen "
                f"{stalled['last_event']}; the controller's last event {stalled['controller_event']}")
    finally:
        if load is not None:
            try:
                load.stop(30 if stalled else 60)
            except Exception:  # noqa: BLE001
                pass
        if cfg.stop_workers:
            for wid in launched:
                _stop_worker(ctl, wid, say, bounded=stalled is not None)
        if cfg.stop_workers and "leaked" in report:
            final = _leak_settle(view, before, {}, _our_netns(seen_cells, report.get("moves", [])))
            report["leaked_after_stop"] = final
            for k, v in final.items():
                report["leaked"][k] = sorted(set(report["leaked"].get(k, [])) | set(v))
        if own:
            ctl.down()
    if view.emulated:  # what a dead host left on this machine (gone with a real host; `down` removes it)
        report["dead_hosts"] = {"hosts": sorted(view.dead), "netns_removed": view.remove_dead_netns()}
    report["seconds"] = round(time.monotonic() - t_all, 1)
    ex = report.get("excluding_router_restart", {})
    report["ok"] = bool(
        not stalled
        and ex.get("failed_requests") == 0
        and ex.get("tokens_lost") == ex.get("tokens_duplicated") == ex.get("tokens_mismatched") == 0
        and ex.get("text_mismatched") == 0
        and not L.total(report.get("leaked", {}))
        and all(o["ok"] for o in report.get("faults", {}).values())
        and all(o["ok"] for o in report.get("scheduling_steps", []) if not o.get("fault"))
        and report.get("plain_moves_done") == report.get("plain_moves"))
    report["verdict"] = "stalled" if stalled else ("ok" if report["ok"] else "failed")
    return report


def _stop_worker(ctl, wid: str, say, bounded: bool, timeout_s: float = 60.0) -> None:
    """Stop one of the run's workers; after a stall, give up on it after `timeout_s` (the
    controller may be gone: `down` then removes what is left of an own cluster)."""
    try:
        if not bounded:
            ctl.stop_worker(wid)
        elif guarded(lambda: ctl.stop_worker(wid), Watch(timeout_s, timeout_s)) is not None:
            say(f"could not stop {wid}: no answer in {timeout_s:g}s")
    except Exception as exc:  # noqa: BLE001
        say(f"could not stop {wid}: {exc}")


#: what each scheduling-layer step kind runs (forced moves run `one_move`)
SCHEDULING_STEPS: dict[StepKind, Callable[..., dict[str, Any]]] = {
    StepKind.SUSPEND_RESUME: suspend_resume,
    StepKind.MAKE_ROOM: make_room,
}


def _p50_phases(moves: list[dict]) -> dict[str, float]:
    acc: dict[str, list[float]] = {}
    for m in moves:
        if m.get("fault") or m.get("result") != "done":
            continue
        for k, v in m.get("phases", {}).items():
            acc.setdefault(k, []).append(v)
    return {k: round(sorted(v)[len(v) // 2], 3) for k, v in acc.items()}
