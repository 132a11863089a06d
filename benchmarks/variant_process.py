"""One benchmark variant in a fresh interpreter, so that its peak memory is its own.

The script runs itself with ``--variant NAME`` and the given options; the variant prints its figures as
one JSON line. Used by train_throughput.py and attention.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run(script: str, variant: str, options: list[str], timeout: float) -> dict[str, Any]:
    """The JSON line ``script --variant variant *options`` printed; a failure becomes ``{"variant", "error"}``."""
    command = [sys.executable, os.path.abspath(script), "--variant", variant, *options]
    env = {**os.environ}
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak_bytes_in_use counts what is used either way
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        return {"variant": variant, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``; ``-`` where either is missing."""
    return "-" if a is None or not b else f"{a / b:.2f}x"
