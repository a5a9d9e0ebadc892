"""Run a script of tests/ under Triton's CPU interpreter in its own process and read its JSON:
``TRITON_INTERPRET=1`` must be set before triton is first imported, so the batched kernels'
tests (tests/fused_interpreted.py, tests/fused_plan_interpreted.py) run apart from pytest's
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(module: str) -> Any:
    """``python -m module`` from the repository root under the interpreter; its stdout as JSON
    (the test fails with the end of its stderr where it exits non-zero)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("GRADTRACE_FUSED_INTERPRET", None)  # the scripts choose their path per trace
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
