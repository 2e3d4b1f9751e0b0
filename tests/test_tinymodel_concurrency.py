"""First use of the tiny model from several threads and processes at once (issue 10).

The README's demo launched two workers in parallel threads on a fresh machine; both generated
the model at once and a lazy `from transformers import ...` raced. Each process here starts
with a cold interpreter (nothing imported yet) and an empty cache, as on a fresh machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relocator.tinymodel import weight_hash

_CALLERS = """
import json, sys, threading
from relocator.tinymodel import ensure_tiny_model
paths, errors = [], []
barrier = threading.Barrier(int(sys.argv[1]))
def call():
    barrier.wait()
    try:
        paths.append(str(ensure_tiny_model()))
    except BaseException as e:
        errors.append(f"{type(e).__name__}: {e}")
threads = [threading.Thread(target=call) for _ in range(int(sys.argv[1]))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"paths": paths, "errors": errors}))
"""


def test_first_use_from_threads_and_processes(tmp_path: Path, tiny_model_dir: Path) -> None:
    cache = tmp_path / "cache"  # empty: nothing generated yet
    env = dict(os.environ, RELOCATOR_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", _CALLERS, "4"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[1])
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    errors = [e for r in results for e in r["errors"]]
    assert errors == []
    paths = {p for r in results for p in r["paths"]}
    assert len(paths) == 1 and sum(len(r["paths"]) for r in results) == 8
    model = Path(paths.pop())
    assert (model / ".complete").exists() and (model / "tokenizer.json").exists()
    # the same bytes as a model built alone (same seed): nothing half-written or mixed
    assert weight_hash(model) == weight_hash(tiny_model_dir)
    for name in ("tokenizer.json", "config.json"):
        assert (model / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    # no temporary folders left behind
    assert [p.name for p in model.parent.iterdir() if p.name.startswith(".tmp")] == []
