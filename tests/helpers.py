"""Small helpers shared by the end-to-end tests on the session cluster."""

from __future__ import annotations

from relocator import waits


def clean(rep: dict, continued: float | None = None) -> None:
    """A load report with traffic, no client error, every token and text as the reference's;
    `continued`: streams the router continued meanwhile (`continued_streams` after minus
    before), given where a move happened under the load: at least one must have been cut over,
    or the test proved nothing about continuation."""
    assert rep["requests"] > 0
    assert rep["client_errors"] == 0, rep["errors"]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0), rep
    assert rep["text_mismatched"] == 0, rep["text_bad"]
    if continued is not None:
        assert continued >= 1, f"a move happened under load but no stream was continued ({continued})"


def continued_streams(router_url: str) -> float:
    """Streams the router has continued after a break (outcome ok), from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text)
               if fam.name == "relocator_router_continued_streams"
               for s in fam.samples if s.name.endswith("_total") and s.labels.get("outcome") == "ok")


def workers(ctl) -> dict[str, dict]:
    return {w["id"]: w for w in ctl.status()["workers"]}


def wait_for(pred, timeout: float = 120.0, what: str = "", poll: float = 0.5) -> None:
    """Until `pred()` holds; a TimeoutError naming `what` after `timeout` s."""
    waits.until(pred, timeout, every=poll, what=what or "a condition")


def listening_ports(pids: set[int], netns: str | None = None) -> dict[int, int]:
    """{TCP port in LISTEN state: its pid} for any of `pids` (ss -tlnp), in network namespace
    `netns` (an emulated host's) or this one."""
    import subprocess

    cmd = ["ss", "-Htlnp"] if netns is None else ["ip", "netns", "exec", netns, "ss", "-Htlnp"]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    ports = {}
    for line in out.splitlines():
        for p in pids:
            if f"pid={p}," in line:
                ports[int(line.split()[3].rsplit(":", 1)[1])] = p
    return ports


def node_of(ctl, worker_id: str) -> str:
    """The node the controller has `worker_id` on."""
    return next(w["node"] for w in ctl.status()["workers"] if w["id"] == worker_id)


def other_node(ctl, worker_id: str) -> str:
    """An alive node other than the worker's with a GPU free (a move's target)."""
    node = node_of(ctl, worker_id)
    return next(n["id"] for n in ctl.status()["nodes"] if n["id"] != node and n["alive"] and n["gpus_free"] >= 1)


def why_not_done(rel: dict) -> str:
    """A relocation record's outcome in one line (pytest cuts a dict's repr before `error`)."""
    return (f"{rel.get('result')} at {rel.get('phase')} ({rel.get('reason')}): {rel.get('error')}; "
            f"mode {rel.get('transfer')}; rollback {rel.get('rollback')}; phases {rel.get('phases')}")
