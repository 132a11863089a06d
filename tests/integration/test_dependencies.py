"""The package's dependencies are what it imports (issue 43, point 6): every third-party module that jamp and
jamp_kernels import is declared in pyproject.toml, and every declared dependency is imported; what only a
framework adapter reads when the user hands it that framework's object (Flax) is not a dependency."""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# distribution name -> import name, where they differ
IMPORT_NAME = {"jaxlib": "jax"}
# imported only where the user passes that framework's objects (jamp.casting.adapters): installed by the user
USER_FRAMEWORKS = {"flax"}


def _imports() -> dict[str, set[str]]:
    """Top-level module -> the files of jamp and jamp_kernels importing it (at module level or inside functions)."""
    found: dict[str, set[str]] = {}
    for package in ("jamp", "jamp_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    found.setdefault(name.partition(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    return {IMPORT_NAME.get(n, n).replace("-", "_") for n in names}


def test_every_imported_package_is_declared_and_every_declared_one_imported():
    imported = {
        m
        for m in _imports()
        if m not in sys.stdlib_module_names and m not in ("jamp", "jamp_kernels") and m not in USER_FRAMEWORKS
    }
    declared = _declared()
    assert imported - declared == set(), f"imported but not declared: {imported - declared}"
    assert declared - imported == set(), f"declared but never imported: {declared - imported}"


def test_user_frameworks_are_read_only_inside_functions():
    """Flax is imported only inside a function of an adapter, so importing jamp never needs it."""
    for path in (ROOT / "jamp").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert (module or "").partition(".")[0] not in USER_FRAMEWORKS, path


def test_the_test_extra_holds_what_the_tests_import():
    extras = PYPROJECT["project"]["optional-dependencies"]
    test = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in extras["test"]}
    for needed in ("flax", "chex", "pytest", "orbax-checkpoint"):
        assert needed in test, needed
