"""A file of finished replay runs, one JSON line each, so that a long `relocator bench replay`
(5 seeds x lists x loads x disciplines x modes: an hour of CPU on a shared machine) keeps every
run as it ends and a second start resumes it: runs already in the file are read back, not run
again. Before this the bench printed one JSON at the very end, and a run stopped half-way left
nothing.

A run is found by its key: the pod list's name, a digest of the input files (node list, pod
list, the list lending times) and the fields of its :class:`ReplayConfig` (the packing options
only for mode ``moves+pack``, the one that reads them). A changed option or
input file is a new key (its runs are made again); a change of the simulator's code is not
seen, so start a new file after one. A last line cut short (the bench killed while writing) is
skipped and that run is made again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from relocator.sim.replay import ReplayConfig, ReplayMode


class RunLogError(ValueError):
    """The runs file cannot be read or is not one."""


def inputs_digest(paths: Iterable[Path]) -> str:
    """A short digest of the input files' bytes (sorted by path, each path once)."""
    h = hashlib.sha256()
    for p in sorted({Path(x) for x in paths}):
        h.update(str(p.name).encode())
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


#: options only mode moves+pack reads: a run of another mode is the same run whatever they are
#: (so a new default of --pack-every does not make the other modes' runs again)
PACK_ONLY = ("pack_every_s", "pack_moves")


def run_key(pods: str, digest: str, cfg: ReplayConfig) -> str:
    """The key of one run: the list's name, the inputs' digest and the configuration (all of it,
    less the packing options for the modes that do not pack)."""
    config = asdict(cfg)
    if ReplayMode(cfg.mode) is not ReplayMode.MOVES_PACK:
        for k in PACK_ONLY:
            config.pop(k, None)
    return json.dumps({"pods": pods, "inputs": digest, "config": config}, sort_keys=True)


def load_runs(path: Path) -> dict[str, dict]:
    """The runs in ``path`` by key ({} when the file does not exist)."""
    if not path.exists():
        return {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RunLogError(f"cannot read runs file {path}: {exc}") from None
    out: dict[str, dict] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # cut short while written: that run is made again
                continue
            raise RunLogError(f"runs file {path}, line {n}: not JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), str) or not isinstance(rec.get("run"), dict):
            raise RunLogError(f"runs file {path}, line {n}: not a run of relocator bench replay (no key and run)")
        out[rec["key"]] = rec["run"]
    return out


def append_run(path: Path, key: str, run: dict) -> None:
    """Add one finished run (with its series: the bench's plot of the first runs needs them)."""
    with path.open("a") as fh:
        fh.write(json.dumps({"key": key, "run": run}) + "\n")
        fh.flush()
