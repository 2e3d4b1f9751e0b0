"""Words every part shares, defined below all of them (imports nothing of ours but `choices`):
the controller, the agent, the cluster and deploy configs, chaos and the bench all name a
transfer mode, so it cannot live in any one of them without imports running back up."""

from __future__ import annotations

from relocator.choices import Choice


class TransferMode(Choice):
    """How the image gets to the target node (docs/snapshots.md "Transfer modes")."""

    SHARED = "shared"  # every node sees the image directory: nothing to copy
    # agent to agent: the memory through a page server on the target while CRIU dumps it,
    # the other images chunked; every file hashed as it arrives
    STREAM = "stream"
    # the worker restarts on the target before its memory has arrived: pages come from the
    # frozen source on demand and in the background; the source is released once all arrived
    POSTCOPY = "postcopy"
    # make-before-break: a second copy starts on the target while the source serves on, is
    # warmed up with the streams in flight (prefix cache), and the router switches to it
    HANDOFF = "handoff"
    # shared when both nodes see the image store, postcopy when both kernels allow it, else stream
    AUTO = "auto"


class PreemptionRule(Choice):
    """What a demand that does not fit does (relocator.controller.preemption, docs/scheduling.md)."""

    PLACE_OR_WAIT = "place-or-wait"  # it waits in the queue: no moves, no preemption
    EVICT_REQUEUE = "evict-requeue"  # lower priorities are killed and requeued (a cold start later)
    SUSPEND_IN_PLACE = "suspend-in-place"  # lower priorities are stopped where they are, then continued
    MOVES = "moves"  # live moves make room, else lower priorities are suspended to storage
