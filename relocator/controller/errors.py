"""Why a relocation stops: the errors the state machine and the transfer strategies raise.

Each carries the `FailureReason` it stands for (a metric label). They live below the machine and
the strategies (relocator.controller.transfers) so both raise the same ones without importing
each other."""

from __future__ import annotations

from relocator.controller.model import FailureReason


class RelocationError(RuntimeError):
    pass


class PlanError(RelocationError):
    """The relocation cannot start (no target, incompatible, busy); nothing was touched."""

    reason = FailureReason.PLAN_REFUSED


class FaultInjected(RelocationError):
    reason = FailureReason.FAULT_INJECTED


class TargetLost(RelocationError):
    """The restored copy is not running any more (before or right after the switch)."""

    reason = FailureReason.TARGET_LOST


class RollbackAfterSwitch(RelocationError):
    """A failure after SWITCH that still rolls back to the stopped source (the source is the
    only complete copy until RELEASE says otherwise); any other RELEASE failure leaves the
    worker on its target."""


class PostCopyFailed(RollbackAfterSwitch):
    """`transfer: postcopy`: the memory did not all arrive after the switch. `why`: target (the
    copy died), source (its page server went away: node lost), stall (no answer: network cut),
    daemon (the lazy-pages daemon failed). The target copy was killed by its keeper (it must
    not run on without its memory); the move rolls back to the frozen source, or, the source
    lost too, the worker is lost and replaced."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why
        self.reason = FailureReason.TARGET_LOST if why == "target" else (
            FailureReason.NODE_LOST if why == "source" else FailureReason.ERROR)


class TargetLostAfterSwitch(RollbackAfterSwitch):
    """`transfer: handoff`: the target copy died after the router switched to it, before RELEASE
    stopped the source. The source never stopped serving: the move rolls back to it (the router
    points back there, the streams cut towards the dead copy continue on it) instead of killing
    the worker's only live copy (CI's chaos smoke: `done`, then the worker lost)."""

    def __init__(self, message: str, reason: FailureReason = FailureReason.TARGET_LOST) -> None:
        super().__init__(message)
        self.reason = reason


class SimulatedCrash(BaseException):
    """Raised by a test's crash hook: the machine stops dead, as if its process had died."""


__all__ = ["FaultInjected", "PlanError", "PostCopyFailed", "RelocationError", "RollbackAfterSwitch",
           "SimulatedCrash", "TargetLost", "TargetLostAfterSwitch"]


class NodeLost(RuntimeError):
    """The node's agent cannot be reached because Ray declared the node dead."""

    reason = FailureReason.NODE_LOST

    def __init__(self, node: str) -> None:
        super().__init__(f"node {node} is lost (Ray declared it dead)")
        self.node = node


__all__ += ["NodeLost"]
