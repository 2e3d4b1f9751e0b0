"""Chaos (issue 6, parts 3-4): forced relocations and injected faults under streaming load.

    from relocator.chaos import ChaosConfig, run_chaos
    report = run_chaos(ChaosConfig(smoke=True), ctl=relocator.connect())

Pure parts (fault catalogue, schedule, outcome checks, leak diff) live in `faults.py` and
`leaks.py`; `runner.py` drives a real cluster.
"""

from relocator.chaos.faults import FAULTS, Fault, Step, check_outcome, make_schedule, parse_faults
from relocator.chaos.leaks import diff_leaks

__all__ = ["FAULTS", "Fault", "Step", "check_outcome", "diff_leaks", "make_schedule", "parse_faults"]


def __getattr__(name):  # the runner imports Ray: only on demand
    if name in ("ChaosConfig", "run_chaos"):
        from relocator.chaos import runner

        return getattr(runner, name)
    raise AttributeError(name)
