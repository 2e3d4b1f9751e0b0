"""Reading openb trace files (Alibaba clusterdata, cluster-trace-gpu-v2023) with clear errors."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from relocator.planner.cluster import MILLI, NodeSpec, Workload

NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"
REFERENCE_FILE = "fgd_reference_default.csv"
ENV_DIR = "RELOCATOR_OPENB_DIR"

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "num_gpu")
"""Columns every pod list must have. The others default as the authors' loader
(alibaba/clusterdata ``cluster-trace-gpu-v2023/pod_csv_to_yaml.py``) defaults them: no
``memory_mib``: no memory request (0); no ``gpu_milli``: whole GPUs (1000 per GPU); no
``gpu_spec``: any GPU model. Their loader does not read ``qos`` or the times at all; here an
absent ``qos`` is empty, an absent ``creation_time`` is 0 and absent deletion/scheduled times
are unknown (``None``). The multi-GPU variants (``openb_pod_list_multigpu*.csv``) have only
``name,cpu_milli,memory_mib,num_gpu,gpu_milli``."""
POD_OPTIONAL = ("memory_mib", "gpu_milli", "gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")

GIB = 1 << 30
MIB = 1 << 20
GPU_STATE_BYTES = 16 * GIB
"""Move cost model for trace pods (the trace has no state sizes): host memory request plus
16 GiB of device state per whole GPU used."""


class TraceError(ValueError):
    """A bad trace file; the message names the file, the line and the column."""

    def __init__(self, path: Path | str, line: int | None, column: str | None, message: str) -> None:
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if column is not None:
            where += f", column {column!r}"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line
        self.column = column


@dataclass(frozen=True)
class TracePod:
    """One pod of a pod list: its resources, submission time (seconds), and, where the list has
    them, deletion and scheduling times (``None``: unknown), QoS class and phase (``""``)."""

    workload: Workload
    creation_time: int
    deletion_time: int | None = None
    scheduled_time: int | None = None
    qos: str = ""
    pod_phase: str = ""

    @property
    def duration(self) -> int | None:
        """Seconds from creation to deletion (``None`` if the list has no deletion time)."""
        if self.deletion_time is None:
            return None
        return max(0, self.deletion_time - self.creation_time)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_trace_dir() -> Path:
    """``$RELOCATOR_OPENB_DIR`` if set, else ``../shared/data/openb`` next to the repository."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    return (repo_root().parent / "shared" / "data" / "openb").resolve()


def _read(path: Path, required: tuple[str, ...]) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    if not path.is_file():
        raise TraceError(path, None, None, "file not found")
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            try:
                header = [h.strip() for h in next(reader)]
            except StopIteration:
                raise TraceError(path, 1, None, "empty file (no header)") from None
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(path, 1, missing[0], f"missing column (header has: {', '.join(header)})")
            rows = []
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise TraceError(path, line, None, f"expected {len(header)} fields, found {len(row)}")
                rows.append((line, dict(zip(header, (c.strip() for c in row)))))
    except UnicodeDecodeError as exc:
        raise TraceError(path, None, None, f"not UTF-8 text ({exc.reason})") from None
    return header, rows


def _int(path: Path, line: int, col: str, value: str, allow_empty: bool = False, default: int = 0) -> int:
    if value == "" and allow_empty:
        return default
    try:
        v = int(value)
    except ValueError:
        try:
            f = float(value)
        except ValueError:
            raise TraceError(path, line, col, f"expected an integer, found {value!r}") from None
        if not f.is_integer():
            raise TraceError(path, line, col, f"expected an integer, found {value!r}") from None
        v = int(f)
    if v < 0:
        raise TraceError(path, line, col, f"must not be negative, found {v}")
    return v


def load_nodes(path: Path | str) -> list[NodeSpec]:
    path = Path(path)
    _, rows = _read(path, NODE_COLUMNS)
    if not rows:
        raise TraceError(path, None, None, "no nodes")
    nodes, seen = [], set()
    for line, r in rows:
        sn = r["sn"]
        if not sn:
            raise TraceError(path, line, "sn", "empty node name")
        if sn in seen:
            raise TraceError(path, line, "sn", f"duplicate node {sn!r}")
        seen.add(sn)
        gpus = _int(path, line, "gpu", r["gpu"])
        nodes.append(
            NodeSpec(sn, _int(path, line, "cpu_milli", r["cpu_milli"]), _int(path, line, "memory_mib", r["memory_mib"]), gpus, r["model"])
        )
    return nodes


def load_pods(path: Path | str) -> list[TracePod]:
    path = Path(path)
    _, rows = _read(path, POD_COLUMNS)
    if not rows:
        raise TraceError(path, None, None, "no pods")
    pods = []
    for line, r in rows:
        name = r["name"]
        if not name:
            raise TraceError(path, line, "name", "empty pod name")
        cpu = _int(path, line, "cpu_milli", r["cpu_milli"])
        mem = _int(path, line, "memory_mib", r.get("memory_mib", ""), allow_empty=True)
        num = _int(path, line, "num_gpu", r["num_gpu"])
        milli = _int(path, line, "gpu_milli", r.get("gpu_milli", ""), allow_empty=True, default=MILLI if num else 0)
        ct = _int(path, line, "creation_time", r.get("creation_time", ""), allow_empty=True)
        dt = _opt_int(path, line, "deletion_time", r.get("deletion_time", ""))
        st = _opt_int(path, line, "scheduled_time", r.get("scheduled_time", ""))
        if dt is not None and dt < ct:
            raise TraceError(path, line, "deletion_time", f"before creation_time ({dt} < {ct})")
        if num == 0 and milli != 0:
            raise TraceError(path, line, "gpu_milli", f"must be 0 for a pod without GPUs, found {milli}")
        if num > 0 and not 0 < milli <= MILLI:
            raise TraceError(path, line, "gpu_milli", f"must be in 1..{MILLI} for a GPU pod, found {milli}")
        if num > 1 and milli != MILLI:
            raise TraceError(path, line, "gpu_milli", f"multi-GPU pods take whole GPUs (1000), found {milli}")
        spec = r.get("gpu_spec", "") or None
        if spec and "|" in spec:
            spec = spec.split("|")[0]  # several accepted models: the planner takes one; keep the first
        bytes_ = mem * MIB + (num * milli * GPU_STATE_BYTES) // MILLI
        w = Workload(name, cpu, mem, num, milli, spec, True, bytes_)
        pods.append(TracePod(w, ct, dt, st, r.get("qos", ""), r.get("pod_phase", "")))
    return pods


def _opt_int(path: Path, line: int, col: str, value: str) -> int | None:
    return None if value == "" else _int(path, line, col, value)


def load_reference(path: Path | str) -> list[dict[str, str]]:
    path = Path(path)
    _, rows = _read(path, ("sc_policy", "unalloc_gpus_at_100", "unalloc_gpus_at_130"))
    out = []
    for line, r in rows:
        for col in ("unalloc_gpus_at_100", "unalloc_gpus_at_130"):
            try:
                float(r[col])
            except ValueError:
                raise TraceError(path, line, col, f"expected a number, found {r[col]!r}") from None
        out.append(r)
    return out
