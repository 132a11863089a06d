"""The house rules that keep the code navigable: small modules, wings that depend only downwards, ruff-clean."""

from __future__ import annotations

import ast
import collections
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jamp", "jamp_kernels")
MAX_LINES = 350

# wing -> the wings it may import (besides itself). The ground floor (jamp._arguments, _floats, _jax_compat,
# _torch_names) imports no wing; jamp/__init__.py, the public face, imports them all.
GROUND = ("jamp._arguments", "jamp._floats", "jamp._jax_compat", "jamp._torch_names")
ALLOWED = {
    "jamp.casting": {*GROUND},
    "jamp.scaling": {*GROUND, "jamp_kernels"},
    "jamp.low_precision_params": {*GROUND},
    "jamp.tools": {*GROUND, "jamp.casting"},
    "jamp.nn": {*GROUND, "jamp.casting"},
    "jamp_kernels": set(),
    **{g: set(GROUND) - {g} for g in GROUND},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _wing(module: str) -> str:
    return next(
        (w for w in sorted(ALLOWED, key=len, reverse=True) if module == w or module.startswith(w + ".")), module
    )


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_module_is_over_350_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_wings_import_only_downwards():
    modules = _modules()
    wrong = collections.defaultdict(set)
    for name, path in modules.items():
        if name == "jamp":
            continue  # the public face
        own = _wing(name)
        for target in _imports(path):
            if target not in modules or target == "jamp":
                continue  # another library, or `from jamp import x` (x is checked as jamp.x)
            other = _wing(target)
            if other != own and other not in ALLOWED.get(own, set()):
                wrong[name].add(target)
    assert not wrong, f"imports that climb back up or sideways: {dict(wrong)}"


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the docs extra (the README's test command)")
@pytest.mark.parametrize("command", [["ruff", "format", "--check", "."], ["ruff", "check", "."]], ids=" ".join)
def test_ruff_is_clean(command):
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
