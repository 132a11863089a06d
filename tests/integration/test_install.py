"""Installing jamp keeps the JAX a user already has (a CUDA build of jax 0.11/0.12 must not be swapped out).

``pip install --dry-run`` of this checkout into the environment running the tests, offline, must plan to
install jax-amp and nothing else JAX-related. Offline, pip could only keep what is installed, so beside the
installed packages it is offered a stand-in release of each JAX-family package jamp depends on (an empty
wheel of another version that jamp's requirement allows): pip takes one only where jamp's requirement
refuses the installed version, and the test names it. CI runs it under jax 0.10.2, 0.11.x and 0.12.x.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import jax
from packaging.requirements import Requirement
from packaging.version import Version

REPO = pathlib.Path(__file__).resolve().parents[2]
JAX_PACKAGES = ("jax", "jaxlib", "jax-cuda", "flax", "optax", "chex", "orbax")


def _other_version(requirement: Requirement) -> str | None:
    """A version ``requirement`` allows that is not the installed one (None: there is none nearby)."""
    installed = Version(importlib.metadata.version(requirement.name))
    major, minor, micro = installed.release + (0,) * (3 - len(installed.release))
    nearby = [f"{major}.{minor}.{micro + 1}", f"{major}.{minor + 1}.0", f"{major + 1}.0.0"]
    nearby += [f"{major}.{minor - 1}.999"] if minor else []
    return next((v for v in nearby if requirement.specifier.contains(v)), None)


def _stand_in(directory: pathlib.Path, name: str, version: str) -> None:
    """An empty wheel of ``name`` ``version``: what an index would offer."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: jamp-tests\nRoot-Is-Purelib: true\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


def test_pip_install_keeps_the_installed_jax(tmp_path):
    offered = {}
    for spec in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(spec)
        if requirement.name.startswith(JAX_PACKAGES) and (version := _other_version(requirement)) is not None:
            _stand_in(tmp_path, requirement.name, version)
            offered[requirement.name] = version
    assert "jax" in offered, f"no stand-in release of jax beside jax {jax.__version__}: the check would be empty"
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(tmp_path),
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
    touched = sorted(
        f"{name} {planned[name]}" for name in planned if name.startswith(JAX_PACKAGES) and name != "jax-amp"
    )
    assert not touched, (
        f"installing jamp would install {touched} (jax {jax.__version__} is installed; offered {offered})"
    )
    assert set(planned) == {"jax-amp"}
