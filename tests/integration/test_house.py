"""The house rules that keep the code navigable: small modules, wings that depend only downwards, ruff-clean."""

from __future__ import annotations

import ast
import collections
import dataclasses
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


# What only jamp/_jax_compat reads of JAX's internals: attributes of equations, literals and thunks ...
_INTERNAL_ATTRIBUTES = {
    "manager": "an equation's context managers (eqn.ctx.manager)",
    "get_bind_params": "a primitive's bind parameters",
    "source_info": "an equation's traceback and name stack",
    "eval_jaxpr": "an evaluation loop (jc.evaluate is the one)",
    "debug_info": "a traced function's debug information",
    "call_wrapped": "a WrappedFun's call",
    "val": "a literal's raw value (jc.literal_value gives it a dtype)",
}
# ... and the parameters of higher-order primitives (a first-order primitive's parameters are the keyword
# arguments of its public lax function, as `preferred_element_type`: rules read those by name).
_INTERNAL_PARAMETERS = {
    "jaxpr", "call_jaxpr", "cond_jaxpr", "body_jaxpr", "branches", "mesh", "subfuns", "debug_info", "length",
    "reverse", "num_consts", "num_carry", "cond_nconsts", "body_nconsts", "in_specs", "out_specs", "name",
    "newly_manual_axes", "ft_in", "ft_out", "jvp_jaxpr_fun", "fwd_jaxpr_thunk", "bwd", "unroll", "linear",
}  # fmt: skip


def _internal_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr in _INTERNAL_ATTRIBUTES:
            found.append(f"{where} .{node.attr}: {_INTERNAL_ATTRIBUTES[node.attr]}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "bind"
            and ast.unparse(node.value).endswith(("primitive", "_p"))
        ):
            found.append(f"{where} {ast.unparse(node)}: a primitive bound (jc.bind_as is the one place)")
        elif isinstance(node, ast.Attribute) and node.attr == "ctx" and ast.unparse(node.value).endswith("eqn"):
            found.append(f"{where} {ast.unparse(node)}: an equation's context managers")
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "jc":
                found.append(f"{where} {ast.unparse(node)}: a higher-order primitive's parameter")
            elif (
                isinstance(key, ast.Constant)
                and key.value in _INTERNAL_PARAMETERS
                and "param" in ast.unparse(node.value)
            ):
                found.append(f"{where} {ast.unparse(node)}: a higher-order primitive's parameter")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{where} import {n}" for n in names if n.startswith(("jax._src", "jax.extend"))]
    return found


def test_jax_internals_are_read_only_in_jax_compat():
    """docs/how-it-works.md: everything jamp reads from JAX's internals is in jamp/_jax_compat/."""
    found = [
        read
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_jax_compat" not in path.parts
        for read in _internal_reads(path)
    ]
    assert not found, "JAX internals read outside jamp/_jax_compat:\n" + "\n".join(found)


def test_autocast_holds_no_tool_state():
    """One path per rule: autocast's context (its caches' key) and rules carry nothing of the precision tools,
    which hook the interpreter's loop from jamp/tools (docs/how-it-works.md)."""
    from jamp.casting.call import Call, Context

    assert {f.name for f in dataclasses.fields(Context)} == {"policy", "mode", "path", "cache_enabled", "recompute"}
    assert not {f.name for f in dataclasses.fields(Call)} & {"frame", "whole"}
    words = ("observer", "shadow", "recorder", "frame.")
    found = [
        f"{path.relative_to(ROOT)}: {word}"
        for path in sorted((ROOT / "jamp" / "casting").rglob("*.py"))
        for word in words
        if word in path.read_text()
    ]
    assert not found, "tool state in autocast:\n" + "\n".join(found)
