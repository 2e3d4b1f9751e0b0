"""The controller: inventory, relocation state machine, reconcile loop, persistence."""

from relocator.controller.machine import FaultInjected, Machine, PlanError, RelocationError, SimulatedCrash
from relocator.controller.model import PHASES, Relocation, WorkerRecord
from relocator.controller.store import Store

__all__ = ["FaultInjected", "Machine", "PHASES", "PlanError", "Relocation", "RelocationError",
           "SimulatedCrash", "Store", "WorkerRecord"]
