"""The documentation site: its code runs, its op reference is the data, and it builds.

1. Every ```python block in docs/**/*.md is executed; the blocks of one page share a namespace and run
   in order. A block preceded by ``<!-- skip: reason -->`` is not run (torch code, mostly). A ```text
   block preceded by ``<!-- expected-output -->`` must equal what the python block before it printed.
2. The op reference pages that docs/hooks/gen_op_reference.py generates at build time show every primitive of
   jamp.casting.oplists under the category jamp.get_policy(device) gives it, and every region rule.
3. ``mkdocs build --strict`` succeeds (skipped where the ``docs`` extra is not installed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import jamp
from jamp.casting import oplists
from jamp.casting.regions import EFFECTIVE_RULE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!--\s*(?P<kind>skip|expected-output)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")


class Block(types.SimpleNamespace):
    lang: str
    code: str
    line: int
    mark: str | None
    reason: str | None


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        mark = MARK.search(before[-1]) if before else None
        out.append(
            Block(
                lang=(m.group("info").strip().split() or [""])[0].strip("{}."),
                code=textwrap.dedent(m.group("body")),
                line=text.count("\n", 0, m.start()) + 1,
                mark=mark and mark.group("kind"),
                reason=mark and mark.group("reason"),
            )
        )
    return out


def _page_id(path: Path) -> str:
    return str(path.relative_to(DOCS))


RUNNABLE = [p for p in PAGES if any(b.lang == "python" for b in blocks(p))]


def test_docs_exist_and_have_code():
    assert (DOCS / "index.md").exists() and len(RUNNABLE) >= 4


@pytest.mark.parametrize("path", RUNNABLE, ids=_page_id)
def test_code_blocks_run(path: Path, monkeypatch):
    monkeypatch.chdir(ROOT)
    name = "docs_" + re.sub(r"\W", "_", _page_id(path))
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # classes defined in a block need a real module
    page = blocks(path)
    for i, block in enumerate(page):
        if block.lang != "python" or block.mark == "skip":
            continue
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block.code, f"{path}:{block.line}", "exec"), module.__dict__)
        nxt = page[i + 1] if i + 1 < len(page) else None
        if nxt is not None and nxt.mark == "expected-output":
            assert stdout.getvalue().strip() == nxt.code.strip(), f"{path}:{block.line}: printed output differs"


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_markers_are_well_formed(path: Path):
    page = blocks(path)
    for i, block in enumerate(page):
        if block.mark == "skip":
            assert block.reason, f"{path}:{block.line}: <!-- skip: reason --> needs a reason"
        if block.mark == "expected-output":
            assert i > 0 and page[i - 1].lang == "python" and page[i - 1].mark != "skip", (
                f"{path}:{block.line}: expected output must follow a python block that runs"
            )


# Columns of a code block that a 1280 px wide browser shows without scrolling (mkdocs-material's content
# column shows 81); `text` blocks wrap instead (docs/stylesheets/extra.css), a `diagram` block is drawn as an
# SVG (docs/hooks/diagrams.py).
CODE_COLUMNS = 80


@pytest.mark.parametrize(
    "path", [*PAGES, ROOT / "README.md"], ids=lambda p: p.name if p.parent == ROOT else _page_id(p)
)
def test_code_lines_fit_the_page(path: Path):
    long = [
        f"{path.name}:{block.line + i + 1}: {len(line)} columns"
        for block in blocks(path)
        if block.lang not in ("text", "diagram")
        for i, line in enumerate(block.code.splitlines())
        if len(line) > CODE_COLUMNS
    ]
    assert not long, f"code lines wider than {CODE_COLUMNS} columns hide behind a scrollbar: {long}"


def test_table_code_breaks_after_punctuation_and_never_inside_a_short_name():
    """docs/hooks/code_in_tables.py: a narrow column splits `enabled=False` at `=`, never into `enabled=Fa` / `lse`."""
    spec = importlib.util.spec_from_file_location("code_in_tables", DOCS / "hooks" / "code_in_tables.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    assert hook.with_breaks("jamp.autocast(enabled=False):") == "jamp.<wbr>autocast(<wbr>enabled=<wbr>False):"
    assert hook.with_breaks("regularized_incomplete_beta") == "regularized_<wbr>incomplete_<wbr>beta"
    assert hook.with_breaks("init_scale=2.0**15") == "init_scale=<wbr>2.0**15"
    assert hook.with_breaks("device_type=&quot;cuda&quot;, dtype=...") == "device_type=<wbr>&quot;cuda&quot;, dtype=..."
    page = "<p><code>a.b</code></p><table><tr><td><code>a.b</code></td></tr></table>"
    assert hook.on_page_content(page) == "<p><code>a.b</code></p><table><tr><td><code>a.<wbr>b</code></td></tr></table>"


def test_skipped_blocks_are_rare():
    all_python = [b for p in PAGES for b in blocks(p) if b.lang == "python"]
    skipped = [b for b in all_python if b.mark == "skip"]
    assert len(skipped) <= max(3, len(all_python) // 5), [b.code[:60] for b in skipped]


# -- 2. the generated op reference -------------------------------------------------------------------


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_op_reference", DOCS / "hooks" / "gen_op_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()


def _sections(page: str) -> dict[str, str]:
    """``## `category` `` heading -> the text under it."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return {parts[i].strip().strip("`"): parts[i + 1] for i in range(1, len(parts), 2)}


def _table_cells(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def test_one_generated_page_per_device_type():
    assert sorted(GEN.pages()) == sorted(f"op-reference/{d}.md" for d in oplists.DEVICE_TYPES)


@pytest.mark.parametrize("device", oplists.DEVICE_TYPES)
def test_generated_page_matches_the_policy(device):
    policy = jamp.get_policy(device)
    sections = _sections(GEN.pages()[f"op-reference/{device}.md"])
    shown: dict[str, str] = {}
    for category in oplists.CATEGORIES:
        if category == oplists.Category.DEFAULT:
            continue
        for row in _table_cells(sections[category])[1:]:
            for prim in re.findall(r"`([^`]+)`", row[0]):
                assert prim not in shown, f"{prim} shown twice"
                shown[prim] = category
    listed = {p for row in oplists.OP_TABLE for p in row.primitives}
    assert set(shown) == listed
    for prim, category in shown.items():
        assert policy.category(prim) == category, prim
    assert f"Compute dtype: `{policy.compute_dtype.name}`" in GEN.pages()[f"op-reference/{device}.md"]
    rules = _table_cells(sections["Region rules"])[1:]
    assert [(r[0].strip("`"), r[2].strip("`")) for r in rules] == [(r.pattern, r.mode) for r in policy.rules]


def test_generated_page_carries_torch_ops_and_reasons():
    page = GEN.pages()["op-reference/gpu.md"]
    for row in oplists.OP_TABLE:
        assert GEN._cell(row.torch_ops) in page and GEN._cell(row.why) in page


def test_region_modes_table_is_effective_rule():
    rows = _table_cells(GEN.region_modes_table())
    header = [c.strip("`") for c in rows[0][1:]]
    for row in rows[1:]:
        mode = row[0].strip("`")
        assert {cat: cell.strip("`") for cat, cell in zip(header, row[1:])} == EFFECTIVE_RULE[mode]
    assert {r[0].strip("`") for r in rows[1:]} == set(EFFECTIVE_RULE)


def test_comparison_and_notes_tables():
    rows = _table_cells(GEN.comparison_table())[1:]
    assert len(rows) == len(oplists.OP_TABLE)
    for cells, row in zip(rows, oplists.OP_TABLE):
        for device, cell in zip(oplists.DEVICE_TYPES, cells[1:]):
            assert cell.strip("`") == getattr(row, oplists.OPLIST_OF_DEVICE[device])
    notes = GEN.torch_only_notes_table()
    assert all(GEN._cell(t) in notes and GEN._cell(n) in notes for t, n in oplists.TORCH_ONLY_NOTES)


def test_fp8_tables_are_the_data():
    from jamp.casting import fp8

    rows = _table_cells(GEN.fp8_formats_table())[1:]
    assert [(r[1].strip("`"), float(r[3])) for r in rows] == [(f.dtype.name, f.max) for f in fp8.FORMATS]
    eligibility = GEN.fp8_eligibility_list()
    assert f"multiples of {fp8.ALIGNMENT}" in eligibility
    assert all(f"`{m}`" in eligibility for m, rules in EFFECTIVE_RULE.items() if rules["lower"] == "lower")


def test_every_marker_in_the_docs_is_known_and_expands():
    used = set()
    for path in PAGES:
        for name in GEN.MARKER.findall(path.read_text()):
            assert name in GEN.MARKERS, f"{path}: unknown marker {name}"
            used.add(name)
    assert used == set(GEN.MARKERS), f"markers never used: {set(GEN.MARKERS) - used}"
    expanded = GEN.expand_markers((DOCS / "op-reference" / "index.md").read_text())
    assert "<!-- jamp:" not in expanded


# The examples extra in pyproject.toml, as import name -> distribution.
EXAMPLES_EXTRA = {
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "equinox": "equinox",
    "flax": "flax",
}


def test_readme_lists_every_example_with_the_extra_it_needs():
    readme = (ROOT / "README.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^examples = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    assert sorted(re.findall(r'"([\w-]+)', extra)) == sorted(EXAMPLES_EXTRA.values())
    for script in sorted((ROOT / "examples").glob("*.py")):
        line = next((ln for ln in readme.split("\n- ") if f"`{script.name}`" in ln), None)
        assert line is not None, f"README.md's example list does not name {script.name}"
        imported = {m.split(".")[0] for m in re.findall(r"^(?:from|import) ([\w.]+)", script.read_text(), re.M)}
        if imported & set(EXAMPLES_EXTRA):
            docstring = script.read_text().split('"""')[1]
            assert ".[examples]" in line and ".[examples]" in docstring, script.name


def test_every_benchmark_is_documented():
    performance = (DOCS / "performance.md").read_text()
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        assert f"benchmarks/{script.name}" in performance, f"docs/performance.md does not describe {script.name}"


# -- 3. mkdocs build --strict -------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    listed = {p for row in oplists.OP_TABLE for p in row.primitives}
    for device in oplists.DEVICE_TYPES:
        html = (site / "op-reference" / device / "index.html").read_text().replace("<wbr>", "")  # code_in_tables.py
        missing = sorted(p for p in listed if f"<code>{p}</code>" not in html)
        assert not missing, f"op-reference/{device}: {missing}"
        assert "<!-- jamp:" not in html
    api = (site / "api" / "index.html").read_text()
    assert "unscale_and_check" in api and "load_state_dict" in api
