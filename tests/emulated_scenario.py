"""The emulated-hosts scenario, run as its own process by tests/test_emulated_hosts.py (the test
session may be attached to another Ray cluster; one process is attached to one).

    python tests/emulated_scenario.py CLUSTER_DIR   # prints one JSON object

On a cluster from `relocator up --emulate-hosts 3` (controller and router on h1): a worker on h2
moved live to h3 under streaming load (`transfer: stream`), a move to h1 rolled back by an
injected restore failure, a move to h2 whose target host dies during RESTORE, host h3 (the
worker's) lost under load, then undeploy. First, what deploy refuses on these hosts (`shared`
transfer, fake GPUs not configured) between an undeploy and a new deploy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "tiny-llama"
STREAMS = 4
MAX_TOKENS = 128


def _load_figures(res: dict) -> dict:
    rel, load = res["relocation"], res["load"]
    return {"result": rel["result"], "error": rel.get("error"), "rollback": rel.get("rollback"),
            "phases": rel["phases"], "transfer": rel["transfer"], "image_bytes": rel.get("image_bytes"),
            **{k: load[k] for k in ("tokens_lost", "tokens_duplicated", "tokens_mismatched", "text_mismatched",
                                    "client_errors", "errors", "blackout_max_s", "requests")}}


def _worker(ctl, wid: str) -> dict:
    return next(w for w in ctl.status()["workers"] if w["id"] == wid)


def node_loss(ctl, info: dict, wid: str, ref) -> dict:
    """Host of `wid` dies under load: every process of its namespace and its cells, SIGKILLed."""
    from relocator.cluster.scenario import lose_host_under_load

    return lose_host_under_load(ctl, info, wid, MODEL, ref, concurrency=STREAMS, max_tokens=MAX_TOKENS)


def mid_move_loss(ctl, info: dict, wid: str, to: str, ref) -> dict:
    """The target host of a live move dies when RESTORE starts (raylet and cells SIGKILLed): the
    move rolls back and the source, on its live host, serves again."""
    from relocator.cluster import emulate
    from relocator.cluster.streams import Load

    cluster = emulate.EmulatedCluster.from_dict(info["emulated"])
    host = next(h for h in cluster.hosts if h.name == to)
    load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, STREAMS).start()
    time.sleep(1.0)
    t0 = time.monotonic()
    rid = ctl.relocate(wid, to=to, transfer="stream", wait=False)["id"]
    killed_at = detected = None
    while True:
        rel = ctl.get_relocation(rid)
        if killed_at is None and rel["phase"] == "RESTORE":
            emulate.kill_host(host)
            killed_at = time.monotonic()
        if killed_at is not None and detected is None and not any(
                n["alive"] for n in ctl.status()["nodes"] if n["id"] == to):
            detected = time.monotonic()
        if rel["result"] != "running":
            break
        time.sleep(0.05)
    t_end = time.monotonic()
    detected = detected or t_end  # declared lost by the move itself before the table said so
    time.sleep(1.0)
    load.stop()
    rep = load.report(window=(t0, t_end))
    rel = ctl.wait_relocation(rid)
    return {"host": to, "killed": killed_at is not None, "result": rel["result"], "error": rel.get("error"),
            "rollback": rel.get("rollback"), "detected_s": round(detected - killed_at, 3) if killed_at else None,
            "serving_after_detection_s": round(t_end - detected, 3),
            "worker_after": {k: _worker(ctl, wid)[k] for k in ("node", "state")},
            **{k: rep[k] for k in ("tokens_lost", "tokens_duplicated", "tokens_mismatched", "text_mismatched",
                                   "client_errors", "errors", "blackout_max_s", "requests")}}


def refusals(address: str) -> dict:
    """Undeploy what `up` deployed, check what deploy refuses on these hosts, deploy again."""
    from relocator.deploy import DeployConfig, DeployError, deploy, undeploy

    out = {"first_undeploy": undeploy(address)}
    # insecure: emulated hosts have no Ray token or router key (docs/deploy.md); the refusals
    # checked here are the hosts' own (shared storage, fake GPUs)
    for what, cfg in (("shared", DeployConfig(nodes={"fake_gpus": True}, controller={"transfer": "shared"},
                                              insecure=True)),
                      ("fake_gpus", DeployConfig(insecure=True))):
        try:
            deploy(address, cfg)
            out[f"refused_{what}"] = None
            undeploy(address)
        except DeployError as exc:
            out[f"refused_{what}"] = {"error": str(exc), "failed": {h: r["failed"] for h, r in exc.report.items()}}
    # the controller's node chosen by name (the NodeAffinity path; h1 is also the head)
    dep = deploy(address, DeployConfig(nodes={"fake_gpus": True}, controller={"node": "h1"}, insecure=True))
    out["redeploy"] = {"id": dep["id"], "nodes": sorted(dep["nodes"]), "controller": dep["controller_node"]["hostname"],
                       "preflight": {h: r["ok"] for h, r in dep["preflight"].items()}}
    try:
        deploy(address, DeployConfig(nodes={"fake_gpus": True}, insecure=True))
        out["second_deploy"] = "accepted"
    except DeployError as exc:
        out["second_deploy"] = str(exc)
    return out


def main(base: str) -> dict:
    import ray

    import relocator
    from relocator.cluster.local import read_info
    from relocator.cluster.scenario import relocate_under_load
    from relocator.deploy import undeploy

    info = read_info(base)
    ctl = relocator.connect(base)
    out: dict = {"nodes": {n["id"]: n["alive"] for n in ctl.status()["nodes"]}}
    out.update(refusals(info["address"]))
    ctl = relocator.connect(address=info["address"])  # the new deployment (its router's URL from Ray)
    w = ctl.launch(MODEL, 2, "h2")
    out["launch"] = {"node": w["node"], "endpoint": w["endpoint"]}
    res = relocate_under_load(ctl, w["id"], "h3", MODEL, concurrency=STREAMS, max_tokens=MAX_TOKENS,
                              transfer="stream", warmup_s=1.0)
    out["move"] = {**_load_figures(res), "worker_after": {k: _worker(ctl, w["id"])[k] for k in ("node", "endpoint")}}
    ref = res["reference"]
    res = relocate_under_load(ctl, w["id"], "h1", MODEL, concurrency=STREAMS, max_tokens=MAX_TOKENS,
                              transfer="stream", faults={"restore": True}, ref=ref, warmup_s=1.0)
    out["rollback"] = {**_load_figures(res), "worker_after": {k: _worker(ctl, w["id"])[k] for k in ("node", "state")}}
    out["mid_move_loss"] = mid_move_loss(ctl, info, w["id"], "h2", ref)
    out["node_loss"] = node_loss(ctl, info, w["id"], ref)
    out["undeploy"] = undeploy(info["address"])
    out["named_actors_after"] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                                 if a.get("namespace") == "relocator"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
