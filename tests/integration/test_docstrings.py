"""Every public name has a docstring in the house style, and every example in it runs and prints what it shows.

The public names are what docs/api.md renders: ``jamp.__all__`` (its ``nn`` module by the functions in
``jamp.nn.__all__``) and ``jamp_kernels.unscale_and_check``, ``unscale`` and ``has_nonfinite``.

* A function's docstring has a one-line summary, ``Args:`` naming every parameter of its signature (``*more``,
  ``**kwargs`` with their stars), ``Returns:`` and ``Examples:``. A class's has a one-line summary,
  ``Attributes:`` naming every field (a warning has none) and ``Examples:``. These are the Google-style
  sections mkdocstrings renders; it takes ``Examples:`` with the ``s`` (``Example:`` is read as an admonition,
  whose ``>>>`` lines render as nested quotes), so no method a class renders may say ``Example:`` either.
* The examples of each docstring run as one doctest, in fresh globals holding jax, jnp, np, optax, jamp and
  jamp_kernels, and must print exactly what they show.
* Every line of code the API page renders from a docstring (its examples: the ``>>>`` and ``...`` lines and
  the output they show; a fenced block) fits in the column a 1280 px window shows without scrolling, as
  the code blocks of the other pages do (tests/integration/test_docs_browser.py sees it in a browser).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import inspect
import io
import pydoc
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import jamp_kernels

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("unscale_and_check", "unscale", "has_nonfinite")
PUBLIC = {
    **{f"jamp.{name}": getattr(jamp, name) for name in jamp.__all__ if name != "nn"},
    **{f"jamp.nn.{name}": getattr(jamp.nn, name) for name in jamp.nn.__all__},
    **{f"jamp_kernels.{name}": getattr(jamp_kernels, name) for name in KERNELS},
}
# Examples whose output holds only on some backends or with an optional package.
CPU_ONLY = {"jamp.nn.cudnn_refusal"}  # a CUDA GPU with cuDNN answers None
NEEDS = {"jamp.nn.equinox_multihead_attention": "equinox"}

SECTION = re.compile(r"^(?P<title>[A-Z][A-Za-z ]*):$", re.M)
ITEM = re.compile(r"^    (?P<name>\*{0,2}[A-Za-z_]\w*)(?: \([^)]*\))?:(?: |$)", re.M)


def sections(doc: str) -> dict[str, str]:
    """``{title: body}`` of the Google-style sections of a cleaned docstring (titles at column 0)."""
    marks = list(SECTION.finditer(doc))
    ends = [m.start() for m in marks[1:]] + [len(doc)]
    return {m["title"]: doc[m.end() : end] for m, end in zip(marks, ends)}


def items(body: str) -> list[str]:
    return ITEM.findall(body)


def parameter_names(fn) -> list[str]:
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values()]


def field_names(cls) -> list[str]:
    if issubclass(cls, Warning):
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields)  # NamedTuples, ScalerTransformation's optax base included


def test_api_page_renders_every_public_name():
    rendered = set(re.findall(r"^::: (\S+)$", (ROOT / "docs" / "api.md").read_text(), re.M))
    assert set(PUBLIC) <= rendered, sorted(set(PUBLIC) - rendered)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_has_its_sections(name):
    obj = PUBLIC[name]
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    summary, _, rest = doc.partition("\n")
    assert summary.strip() and (not rest or rest.startswith("\n")), f"{name}: the summary is not one line"
    found = sections(doc)
    members = {f"{name}.{k}": v for k, v in vars(obj).items() if not k.startswith("_")} if inspect.isclass(obj) else {}
    for where, text in [(name, doc), *((k, inspect.getdoc(v)) for k, v in members.items())]:
        singular = "Example" in sections(text or "")
        assert not singular, f"{where}: write 'Examples:' (mkdocstrings renders 'Example:' as an admonition)"
    if inspect.isclass(obj):
        wanted = {"Attributes", "Examples"} if field_names(obj) else {"Examples"}
        assert wanted <= found.keys(), f"{name}: sections {sorted(found)}, wants {sorted(wanted)}"
        if field_names(obj):
            missing = [f for f in field_names(obj) if f not in items(found["Attributes"])]
            assert not missing, f"{name}: Attributes does not describe {missing}"
    else:
        wanted = {"Args", "Returns", "Examples"}
        assert wanted <= found.keys(), f"{name}: sections {sorted(found)}, wants {sorted(wanted)}"
        listed = items(found["Args"])
        assert listed == parameter_names(obj), f"{name}: Args lists {listed}, the signature has {parameter_names(obj)}"
    assert ">>> " in found["Examples"], f"{name}: the Examples section has no doctest"


def run_examples(name: str) -> str:
    """The doctest report of ``name``'s examples: "" when they all print what they show."""
    globs = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jamp": jamp, "jamp_kernels": jamp_kernels}
    tests = [t for t in doctest.DocTestFinder().find(PUBLIC[name], name, globs=globs) if t.examples]
    if not tests:
        return f"{name} has no example\n"
    out = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False)
    for test in tests:
        runner.run(test, out=out.write)
    return out.getvalue() if runner.failures else ""


def test_docstring_examples_run():
    """One test for all names: the examples share the process's compiled programs (a scaler's first eager
    ``tx.update`` compiles some seventy small ones), which separate tests on separate workers would not."""
    skipped = {name for name in CPU_ONLY if jax.default_backend() != "cpu"}  # their output is a CPU's
    skipped |= {name for name, module in NEEDS.items() if importlib.util.find_spec(module) is None}
    failures = "".join(run_examples(name) for name in sorted(PUBLIC) if name not in skipped)
    assert not failures, failures


# Columns of a docstring's code block that docs/api.md shows whole in a 1280 px window: measured in headless
# Chromium (tests/browser.py) on the built API page, where every code block, an example's included, is as
# wide as on the other pages (688 px, 16 px padding each side, 8.18 px a character at 13.6 px: 80 columns;
# an 81st hides 7 px behind a scrollbar). A class's members render their docstrings at that width too.
EXAMPLE_COLUMNS = 80
DOCTEST_FLAGS = re.compile(r"\s*#\s*doctest:.+$")  # mkdocstrings trims them from what it renders
RENDERED = re.compile(r"^::: (?P<name>\S+)\n(?:    options:\n      members: \[(?P<members>[^\]]*)\]\n)?", re.M)


def rendered_docstrings() -> dict[str, str]:
    """``{name: docstring}`` of everything docs/api.md renders: each ``::: name`` entry and its public members
    (a module's as its ``members:`` option lists them)."""
    docs = {}
    for entry in RENDERED.finditer((ROOT / "docs" / "api.md").read_text()):
        obj = pydoc.locate(entry["name"])
        assert obj is not None, f"docs/api.md renders {entry['name']}, which does not import"
        if entry["members"]:
            members = {m.strip(): getattr(obj, m.strip()) for m in entry["members"].split(",")}
        else:
            members = {k: v for k, v in vars(obj).items() if not k.startswith("_")} if inspect.isclass(obj) else {}
        for name, value in {"": obj, **members}.items():
            doc = value.__doc__ if callable(value) or isinstance(value, property) or inspect.ismodule(value) else None
            if doc:
                docs[f"{entry['name']}.{name}".rstrip(".")] = inspect.cleandoc(doc)
    return docs


def code_lines(doc: str) -> list[str]:
    """The lines of a cleaned docstring that render as code, as wide as they render: each example of its
    ``Examples:`` section (a ``>>>`` line and all that follows it up to a blank line, dedented, doctest flags
    trimmed) and each fenced block anywhere."""
    lines, fence = [], None  # the indentation of the open fence
    for line in doc.splitlines():
        if line.strip().startswith("```"):
            fence = None if fence is not None else len(line) - len(line.lstrip())
        elif fence is not None:
            lines.append(line[fence:])
    example = False
    for line in textwrap.dedent(sections(doc).get("Examples", "")).splitlines():
        example = bool(line.strip()) and (example or line.startswith(">>>"))
        if example:
            lines.append(DOCTEST_FLAGS.sub("", line))
    return lines


def test_code_lines_fit_the_api_page():
    """What a 1280 px window shows of a docstring's examples: nothing hides behind a scrollbar. Split a long
    statement over ``...`` lines, name a value on its own line, or print a dict one key a line."""
    docs = rendered_docstrings()
    assert set(PUBLIC) <= docs.keys(), sorted(set(PUBLIC) - docs.keys())
    long = [
        f"{name}: {len(line)} columns: {line.strip()[:60]}"
        for name, doc in docs.items()
        for line in code_lines(doc)
        if len(line) > EXAMPLE_COLUMNS
    ]
    assert not long, (
        f"{len(long)} code lines wider than {EXAMPLE_COLUMNS} columns hide behind a scrollbar:\n" + "\n".join(long)
    )
