"""`Injector`: a fault injected from outside the controller, with the real mechanism (kill a
process, cut a connection, flip a byte, lose a node), once the relocation reaches its phase."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from relocator import waits
from relocator.chaos.faults import Fault
from relocator.chaos.hosts import LocalView
from relocator.chaos.leaks import RULE_TAG
from relocator.chaos.probe import _kill
from relocator.procs import criu_processes, descendants, process_table


#: the phases of a move before its RESTORE (a handoff's target copy starts in RESTORE)
_BEFORE_RESTORE = ("PLAN", "RESERVE", "HOLD", "DUMP", "TRANSFER")


def handoff_window(rel: dict, now: float, pause_s: float) -> str | None:
    """Where a handoff move is, for a kill while its target copy warms up: "warm-up" (RESTORE,
    the copy started: its endpoint is recorded), "pause" (SWITCH entered under `pause_s` ago: the
    controller still waits before the router switches), "over" (too late, or the move ended), or
    None (not yet: the copy is still starting)."""
    phase = rel.get("phase")
    if rel.get("result") != "running":
        return "over"
    if phase == "RESTORE":
        return "warm-up" if rel.get("dst_endpoint") else None
    if phase == "SWITCH":
        started = (rel.get("phases") or [{}])[-1].get("started")
        return "pause" if started and now - float(started) < pause_s - 0.1 else "over"
    return None if phase in _BEFORE_RESTORE else "over"


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
        ACTIONS[self.fault.name](self, rel, still)

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
        # CRIU dump in flight
        seen = bool(waits.settle(lambda: criu_processes(process_table(), "dump", rid), 5, every=0.01))
        if still().get("phase") != "DUMP":
            return
        self._kill_agent(rel["src"], criu_dump_running=seen)

    def _cut_transfer(self, rel: dict, still) -> None:
        """The target's page server, once the dump's pages flow into it."""
        rid = rel["id"]

        def cut() -> bool:  # True: done (cut, or the dump is over)
            if still().get("phase") != "DUMP":
                return True
            for pid in criu_processes(process_table(), "page-server", rid):
                img = self.view.path(rel["dst"], rel.get("dst_image_dir") or "")
                got = sum(p.stat().st_size for p in img.glob("pages-*.img")) if img.is_dir() else 0
                if got > (8 << 20) and _kill(pid):
                    self._mark(killed="target page server", pid=pid, bytes_received=got)
                    return True
            return False

        waits.settle(cut, 10, every=0.005)

    def _throttle_bps(self) -> float:
        """The pace the fault sets on the post-copy (its controller fault `postcopy`); 0: none."""
        for hook, knobs in self.fault.controller_faults:
            if hook == "postcopy":
                return float(dict(knobs).get("throttle_bps") or 0.0)
        return 0.0

    def _postcopy_session(self, rel: dict, still, timeout: float = 20.0, ahead_s: float = 1.0) -> dict | None:
        """The post-copy state of the move's target copy once its keeper relays pages and, at the
        fault's pace, at least `ahead_s` of its memory is still to come. The keeper flushes its
        state five times a second, so a copy that has just got its last pages still reads
        `running` for a while: CI's chaos smoke once killed such a copy after its move was done
        (then the worker was lost, not rolled back). A post-copy too short for that margin is
        taken at its first sighting."""
        from relocator.agent.postcopy import read_state

        cdir = self.view.state_dir(rel["dst"]) / "cells" / rel["dst_cell"]
        bps = self._throttle_bps()

        def look() -> tuple[dict | None] | None:  # (the session or None): the wait is over
            if still().get("phase") != self.fault.phase:
                return (None,)
            st = read_state(cdir) or {}
            arrived = int(st.get("page_bytes", 0) or 0)
            if st.get("state") == "running" and arrived > 0:
                lazy = int(st.get("lazy_bytes", 0) or 0)
                if not bps or lazy < 2 * bps * ahead_s or lazy - arrived >= bps * ahead_s:
                    return (st,)
                return (None,)  # too late to land inside the post-copy: not injected
            return (None,) if st.get("state") in ("done", "failed") else None

        found = waits.settle(look, timeout, every=0.01)
        return found[0] if found else None

    def _postcopy_kill_target(self, rel: dict, still) -> None:
        st = self._postcopy_session(rel, still)
        init = self._cell_init(rel["dst"], rel["dst_cell"]) if st is not None else None
        if init is None:
            return
        if _kill(init):
            self._mark(killed="target copy during post-copy", pid=init, page_bytes=st.get("page_bytes"),
                       lazy_bytes=st.get("lazy_bytes"))

    def _postcopy_network_cut(self, rel: dict, still) -> None:
        st = self._postcopy_session(rel, still)
        pc = rel.get("postcopy") or {}
        port = pc.get("port")
        if st is None or not port:
            return
        tag = f"{RULE_TAG}{rel['id']}"
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
        self._iptables_drop([("INPUT", r) for r in rules], tag)
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

        def kill() -> bool:  # True: done (killed, or the restore is over)
            table = process_table()
            for pid in criu_processes(table, "restore", rid):
                kids = descendants(pid, table)
                if kids:
                    for k in kids:
                        _kill(k)
                    self._mark(killed="tasks under criu restore", pids=kids)
                    return True
            init = self._cell_init(rel["dst"], dst_cell)
            if init and still().get("phase") == "RESTORE" and _kill(init):
                self._mark(killed="restored cell init", pids=[init])
                return True
            return still().get("phase") != "RESTORE"

        waits.settle(kill, 20, every=0.005)

    def _cell_init(self, node: str, cell: str) -> int | None:
        """The host PID of `cell`'s init on `node` (its cell.json), None when it has none (yet)."""
        try:
            return int(json.loads((self.view.state_dir(node) / "cells" / cell / "cell.json").read_text())["init_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _pause_s(self) -> float:
        return float((self.fault.relocate_faults().get("pause") or {}).get("s", 0.0))

    def _handoff_kill(self, still, side: str) -> None:
        """Kill the handoff's target (`side` "dst") or source ("src") copy once the target has
        started and warms up (or in the pause before SWITCH): handoff_window."""
        pause = self._pause_s()

        def look() -> tuple[dict, str] | None:
            r = still()
            where = handoff_window(r, time.time(), pause)
            return (r, where) if where else None

        found = waits.settle(look, 300, every=0.02)  # a cold target takes a minute or more
        if not found or found[1] == "over":
            return
        r, where = found
        init = self._cell_init(r[side], r[f"{side}_cell"])
        if init and _kill(init):
            self._mark(killed=f"{'target' if side == 'dst' else 'source'} copy", pid=init, window=where)

    def _handoff_kill_target_warmup(self, rel: dict, still) -> None:
        self._handoff_kill(still, "dst")

    def _handoff_kill_source_warmup(self, rel: dict, still) -> None:
        self._handoff_kill(still, "src")

    def _in_switch(self, rel: dict, still, after_s: float) -> tuple[dict, float] | None:
        """(the move, when SWITCH started) once `after_s` into SWITCH, if it is still there."""
        started = float((rel.get("phases") or [{}])[-1].get("started") or time.time())
        time.sleep(max(0.0, started + after_s - time.time()))
        r = still()
        if r.get("phase") != "SWITCH" or r.get("result") != "running":
            return None
        return r, started

    def _handoff_kill_target_switch(self, rel: dict, still) -> None:
        """The target copy, right after the pause before SWITCH: the controller's check of the
        target has passed, the router's catch-up and cut are under way."""
        found = self._in_switch(rel, still, self._pause_s() + 0.05)
        if found is None:
            return
        r, started = found
        init = self._cell_init(r["dst"], r["dst_cell"])
        if init and _kill(init):
            self._mark(killed="target copy", pid=init, window="switch",
                       after_switch_start_s=round(time.time() - started, 3))

    def _handoff_network_cut_switch(self, rel: dict, still) -> None:
        """Cut the router off the target copy halfway through the pause before SWITCH (the
        controller's check of the target has passed; the router's call comes next)."""
        found = self._in_switch(rel, still, self._pause_s() / 2)
        if found is None:
            return
        r, started = found
        url = urlsplit(r.get("dst_endpoint") or "")
        if not url.hostname or not url.port:
            return
        host, port = url.hostname, str(url.port)
        # the router's requests to the target leave through OUTPUT (loopback or the emulated
        # hosts' bridge alike), its answers come in through INPUT
        rules = [("OUTPUT", ["-p", "tcp", "-d", host, "--dport", port]),
                 ("INPUT", ["-p", "tcp", "-s", host, "--sport", port])]
        self._iptables_drop(rules, f"{RULE_TAG}{rel['id']}")
        self._mark(cut=f"router <-> target copy {host}:{port} (tcp, both ways)", window="switch",
                   after_switch_start_s=round(time.time() - started, 3))

    def _iptables_drop(self, rules: list[tuple[str, list[str]]], tag: str) -> None:
        """DROP rules (chain, match) tagged `tag`, removed by cleanup()."""
        for chain, match in rules:
            subprocess.run(["iptables", "-I", chain, *match, "-m", "comment", "--comment", tag, "-j", "DROP"],
                           check=True, capture_output=True)
            self._cleanups.append(lambda c=chain, m=match: subprocess.run(
                ["iptables", "-D", c, *m, "-m", "comment", "--comment", tag, "-j", "DROP"], capture_output=True))

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

    def _restart_router(self, rel: dict, still) -> None:
        from loadtests.abuse import listener_pid
        from relocator.cluster.local import read_info

        # the daemon records the router it runs (it also holds the listening socket itself)
        url = urlsplit(self.ctl.router_url)
        pid = (read_info(self.base) or {}).get("router_pid") or listener_pid(url.port, url.hostname)
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


#: how each fault the runner injects acts, by the fault's name (faults.FAULTS; the ones the
#: controller injects itself, like fail-make-room-move, have none)
ACTIONS: dict[str, Callable[[Injector, dict, Callable[[], dict]], None]] = {
    "kill-source-agent": Injector._kill_source_agent,
    "cut-transfer": Injector._cut_transfer,
    "flip-byte": Injector._flip_byte,
    "kill-target-cell": Injector._kill_target_cell,
    "kill-controller": Injector._kill_controller,
    "kill-controller-switch": Injector._kill_controller,
    "restart-router": Injector._restart_router,
    "node-loss": Injector._node_loss,
    "postcopy-kill-target": Injector._postcopy_kill_target,
    "postcopy-network-cut": Injector._postcopy_network_cut,
    "postcopy-source-loss": Injector._postcopy_source_loss,
    "handoff-kill-target-warmup": Injector._handoff_kill_target_warmup,
    "handoff-kill-target-switch": Injector._handoff_kill_target_switch,
    "handoff-kill-source-warmup": Injector._handoff_kill_source_warmup,
    "handoff-network-cut-switch": Injector._handoff_network_cut_switch,
}
