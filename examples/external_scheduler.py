"""An external scheduler that embeds relocator's controller: it submits jobs with priorities and
time limits, lets the controller make room (live moves, then suspends of lower priorities), and
follows demands and relocations as they change.

    python examples/external_scheduler.py --cluster-dir /var/lib/relocator/cluster
"""

from __future__ import annotations

import argparse
import threading

import relocator


def follow(ctl, stop: threading.Event) -> None:
    """Print what the controller decides: demands seated or queued, moves, suspends, resumes."""
    kinds = ["demand_pending", "demand_placed", "room_planned", "worker_suspended", "worker_resumed",
             "relocation_finished", "consolidated"]
    for ev in ctl.events(kinds=kinds, idle_timeout=5):
        print(f"[{ev['seq']}] {ev['kind']}: " + ", ".join(f"{k}={v}" for k, v in ev.items()
                                                          if k not in ("seq", "ts", "kind")))
        if stop.is_set():
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster-dir")
    args = ap.parse_args()
    ctl = relocator.connect(args.cluster_dir)
    stop = threading.Event()
    watcher = threading.Thread(target=follow, args=(ctl, stop), daemon=True)
    watcher.start()

    jobs = [  # (gpus, priority, time limit)
        (1, 0, None), (1, 0, None),  # two small batch workers
        (4, 0, "30m"),  # a big one with a wall-time limit
        (4, 5, None),  # an urgent one: may suspend lower priorities if moves are not enough
    ]
    placed = []
    for gpus, priority, limit in jobs:
        plan = ctl.launch("tiny-llama", gpus=gpus, priority=priority, time_limit=limit, dry_run=True)["plan"]
        print(f"{gpus} GPU(s), priority {priority}: {plan['how']} on {plan['node']} "
              f"({len(plan['moves'])} move(s), suspends {plan['suspends']})")
        out = ctl.launch("tiny-llama", gpus=gpus, priority=priority, time_limit=limit)
        if out.get("state") == "pending":
            print(f"  {out['id']} waits: {out['demand']['reason']}")
        else:
            placed.append(out["id"])
            print(f"  {out['id']} serves on {out['node']}")
    print("pending:", [(d["id"], d["kind"], d["gpus"], d["reason"]) for d in ctl.pending()])
    print("consolidation plan:", ctl.consolidate(dry_run=True))
    # clean up: the controller resumes requeued workers when capacity returns; here we stop all
    for d in ctl.pending():
        ctl.cancel(d["id"])
    for w in ctl.status()["workers"]:
        ctl.stop_worker(w["id"])
    stop.set()


if __name__ == "__main__":
    main()
