"""GPU shares: how many GPUs a worker or a demand takes, whole or a fraction of one.

The one representation, everywhere (worker and demand records, the scheduling view, the CLI,
status, metrics, the router table): a number `gpus`,

- a whole number >= 1 (an `int`): that many whole GPUs;
- a fraction in (0, 1), a multiple of 1/100 (a `float`, e.g. 0.25): a share of one GPU.
  Several shares sit on one GPU id; whole and shared workers mix on one node.

Why hundredths: the planner counts in milli-GPU (`planner.MILLI`, the openb trace's
`gpu_milli`), so a share is `round(gpus * 1000)` milli exactly (0.01 = 10 milli, like
gpu_milli/10); finer shares than 1 % of a GPU's memory hold no useful KV pool, and Ray's own
resource resolution (1/10000) is finer still. Anything else (0, negative, 0.0001, 1.5, "abc")
is refused by `parse_gpus` with one line (ValueError).

Expressed
- to Ray: a placement-group bundle {"GPU": gpus} (fractional for a share): Ray packs shares
  best-fit onto GPU instances (the fullest GPU that still fits, as `planner.Cluster`'s
  default_gpus does), and gives the worker that GPU's id;
- to the planner: `planner.Workload(num_gpu, gpu_milli)` from `shape(gpus)`
  (a share: num_gpu=1, gpu_milli < 1000; whole: gpu_milli=1000);
- to the engine: its memory share (`engine_memory`): vLLM's --gpu-memory-utilization, which on
  the CPU reference is the share of host memory its KV pool takes, scaled by the share.

Pure and low (imports nothing of ours): the controller, the CLI and `relocator why` read it.
"""

from __future__ import annotations

import math

MILLI = 1000  # one whole GPU in milli-GPU (= planner.MILLI; not imported: this module stays low)
STEP = 0.01  # the share granularity (a multiple of 1/100 of one GPU)
_HUNDREDTHS = 100


def parse_gpus(value: object) -> int | float:
    """`value` (a number or its text) as GPUs: an int >= 1, or a float in (0, 1) that is a
    multiple of 0.01. ValueError with one line otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"gpus must be a number, not {value!r}")
    try:
        x = float(str(value).strip()) if not isinstance(value, (int, float)) else float(value)
    except ValueError:
        raise ValueError(f"gpus must be a whole number >= 1 or a share in (0, 1) such as 0.25, "
                         f"not {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"gpus must be > 0 (a whole number >= 1 or a share in (0, 1)), not {value!r}")
    if x >= 1:
        if x != int(x):
            raise ValueError(f"gpus above 1 must be whole (a worker takes a share of one GPU, or whole "
                             f"GPUs), not {value!r}")
        return int(x)
    hundredths = round(x * _HUNDREDTHS)
    if hundredths < 1 or abs(hundredths - x * _HUNDREDTHS) > 1e-6:
        raise ValueError(f"a GPU share must be a multiple of {STEP} in (0, 1), not {value!r}")
    return hundredths / _HUNDREDTHS


def is_share(gpus: float) -> bool:
    """A fraction of one GPU (not whole GPUs)."""
    return 0 < gpus < 1


def milli(gpus: float) -> int:
    """The total milli-GPU `gpus` stands for (0.25 -> 250, 2 -> 2000)."""
    return int(round(gpus * MILLI))


def shape(gpus: float) -> tuple[int, int]:
    """(num_gpu, gpu_milli per GPU) of the planner's Workload: a share takes one GPU in part."""
    if gpus <= 0:
        return 0, 0
    if is_share(gpus):
        return 1, milli(gpus)
    return int(round(gpus)), MILLI


def count(x: float) -> int | float:
    """A GPU amount as shown and stored: an int when whole, else rounded to hundredths (Ray's
    available GPUs after shares, e.g. 3.25; float sums such as 0.1 + 0.2 lose their dust)."""
    r = round(float(x), 2)
    return int(r) if r == int(r) else r


def label(gpus: float) -> str:
    """"0.25" for a share, "2" for whole GPUs."""
    return str(count(gpus))


def engine_memory(gpus: float, base: float) -> float | None:
    """The engine's memory fraction for a worker of `gpus`: `base` (the engine's own default,
    LaunchSpec.memory_fraction) scaled by the share, or None for whole GPUs (unchanged)."""
    if not is_share(gpus):
        return None
    return round(base * gpus, 4)
