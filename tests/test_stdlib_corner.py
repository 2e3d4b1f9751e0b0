"""The stdlib-only corner: the post-copy keeper, pump and TLS front run under `python -S` (no site-packages),
so they, and everything they import, must load without psutil, tenacity or the agent's side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import sys
import relocator.agent.postcopy.keeper, relocator.agent.pump, relocator.agent.front
from relocator.snapshot import criu, images
from relocator import credentials
third = sorted(m for m in sys.modules if m.split('.')[0] in ('psutil', 'tenacity', 'pydantic', 'ray'))
mine = sorted(m for m in sys.modules if m in ('relocator.procs', 'relocator.waits'))
print(third, mine)
"""


def test_the_keeper_and_pump_load_under_python_dash_S():
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] []"


def test_the_keeper_entry_point_still_answers_on_its_old_module_name():
    out = subprocess.run([sys.executable, "-S", "-m", "relocator.agent.postcopy", "--help"], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 0 and "--source-port" in out.stdout, out.stderr[-2000:]
