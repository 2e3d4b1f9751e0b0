"""relocator.sim: trace-driven simulator of placement with and without relocation (openb trace)."""

from relocator.sim.engine import SimResult, aggregate, build_workload, run_many, simulate
from relocator.sim.trace import (
    ENV_DIR,
    NODE_FILE,
    POD_FILE,
    REFERENCE_FILE,
    TraceError,
    TracePod,
    default_trace_dir,
    load_nodes,
    load_pods,
    load_reference,
)

__all__ = [
    "ENV_DIR",
    "NODE_FILE",
    "POD_FILE",
    "REFERENCE_FILE",
    "SimResult",
    "TraceError",
    "TracePod",
    "aggregate",
    "build_workload",
    "default_trace_dir",
    "load_nodes",
    "load_pods",
    "load_reference",
    "run_many",
    "simulate",
]
