"""Installing jamp keeps the JAX a user already has (a CUDA build of jax 0.11/0.12 must not be swapped out).

``pip install --dry-run`` of this checkout into the environment running the tests, offline
(``--no-index``: pip may only keep what is installed), must plan to install jax-amp and nothing else
JAX-related. CI runs it under jax 0.10.2, 0.11.x and 0.12.x.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax

REPO = pathlib.Path(__file__).resolve().parents[2]
JAX_PACKAGES = ("jax", "jaxlib", "jax-cuda", "flax", "optax", "chex", "orbax")


def test_pip_install_keeps_the_installed_jax(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(report),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"pip cannot install jamp beside jax {jax.__version__}:\n{proc.stderr[-3000:]}"
    planned = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "jax-amp" in planned
    touched = sorted(name for name in planned if name.startswith(JAX_PACKAGES) and name != "jax-amp")
    assert not touched, f"installing jamp would change {touched} (jax {jax.__version__} is installed)"
