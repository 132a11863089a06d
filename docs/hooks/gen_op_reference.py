"""MkDocs hook: the op reference, generated from jamp's tables at build time.

Nothing here is a copy of jamp's op lists. Every table is computed from the data jamp itself runs on:
``jamp.casting.oplists`` (``OP_TABLE``, ``CATEGORIES``, ``TORCH_ONLY_NOTES``, ``DEVICE_TYPES``), the built-in
policies returned by ``jamp.get_policy(device)`` (the category of each primitive, the region rules,
the compute dtype), ``jamp.casting.regions.EFFECTIVE_RULE`` (region mode x category) and
``jamp.casting.rules.HIGHER_ORDER_RULES``; the fp8 tables come from ``jamp.casting.fp8``, the accumulation
table from ``jamp.casting.accumulation``.

Two mechanisms, both used by ``mkdocs.yml`` (``hooks: [docs/hooks/gen_op_reference.py]``):

* ``on_files`` adds one generated page per device type, ``op-reference/<device>.md``
  (:func:`device_page`); it also adds a placeholder for a page named in the nav that nobody has
  written yet (:data:`PLACEHOLDERS`), so ``mkdocs build --strict`` does not depend on it.
* ``on_page_markdown`` replaces ``<!-- jamp:NAME -->`` markers in hand-written pages with the
  table :data:`MARKERS` [NAME] produces.
* ``on_page_content`` drops the Sphinx roles (``:func:``, ``:mod:``) that jamp's docstrings use
  in front of code spans, which markdown would show literally.

``tests/integration/test_docs.py`` imports this module and checks the generated tables against the data.
"""

from __future__ import annotations

import re

import jax.numpy as jnp

import jamp
from jamp.casting import accumulation, fp8, oplists, policy
from jamp.casting.dtypes import ELIGIBLE_DTYPES
from jamp.casting.regions import EFFECTIVE_RULE, LeafRule
from jamp.casting.rules import HIGHER_ORDER_RULES

# The order in which categories are shown; every category in jamp.casting.oplists.CATEGORIES must appear.
CATEGORY_ORDER = tuple(oplists.Category)

DEVICE_TITLES = {
    "gpu": 'GPU policy (`device_type="gpu"` or `"cuda"`)',
    "cpu": 'CPU policy (`device_type="cpu"`)',
    "tpu": 'TPU policy (`device_type="tpu"`)',
}

OPLIST_NAMES = {"gpu": "torch's CUDA list", "cpu": "torch's CPU list"}

# Pages named in the nav that other people write; a placeholder is built only while one is missing.
PLACEHOLDERS = {
    "distributed.md": "Distributed training",
    "robustness.md": "Robustness",
}

MARKER = re.compile(r"<!-- jamp:([a-z0-9-]+) -->")

# Sphinx roles in jamp's docstrings (":func:`x`") render literally in markdown; keep the code span.
SPHINX_ROLE = re.compile(r":(?:func|mod|class|meth|attr|data|obj):(?=<code>)")


# -- helpers ---------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Plain text safe inside a markdown table cell: no emphasis from ``x ** 2``, no HTML, no column breaks."""
    text = " ".join(str(text).split())
    for char in "\\*|<`":
        text = text.replace(char, "\\" + char)
    return text


def _code(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _md_cell(text: str) -> str:
    """Markdown (code spans allowed) safe inside a table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def category_descriptions() -> dict[str, str]:
    """category -> its description, parsed from the ``jamp.casting.oplists`` module docstring."""
    doc = oplists.__doc__ or ""
    found = {}
    for match in re.finditer(r"^- ``(\w+)``(?: \([^)]*\))?: (.*?)(?=^- ``|\Z|^\s*$)", doc, re.M | re.S):
        found[match.group(1)] = " ".join(match.group(2).split()).replace("``", "`")
    missing = [c for c in oplists.CATEGORIES if c not in found]
    if missing:
        raise RuntimeError(f"jamp.casting.oplists' docstring describes no category {missing}")
    return found


def _check_categories() -> None:
    if set(CATEGORY_ORDER) != set(oplists.CATEGORIES):
        raise RuntimeError(
            f"CATEGORY_ORDER {CATEGORY_ORDER} does not match jamp.casting.oplists.CATEGORIES "
            f"{oplists.CATEGORIES}: update docs/hooks/gen_op_reference.py"
        )


# -- per-device pages ------------------------------------------------------------------------------


def policy_rows(device: str) -> dict[str, list[tuple[tuple[str, ...], oplists.OpRow]]]:
    """category -> [(primitives of one OP_TABLE row in that category, the row)] for ``device``'s
    built-in policy. Categories come from ``jamp.get_policy(device)``, the row text from OP_TABLE."""
    _check_categories()
    policy = jamp.get_policy(device)
    out: dict[str, list] = {c: [] for c in CATEGORY_ORDER}
    for row in oplists.OP_TABLE:
        by_cat: dict[str, list[str]] = {}
        for prim in row.primitives:
            by_cat.setdefault(policy.category(prim), []).append(prim)
        for cat, prims in by_cat.items():
            out[cat].append((tuple(prims), row))
    return out


def category_table(device: str, category: str) -> str:
    rows = policy_rows(device)[category]
    return _table(
        ("JAX primitives", "torch.amp ops it stands for", "why"),
        [(_code(prims), _cell(row.torch_ops), _cell(row.why)) for prims, row in rows],
    )


def region_rules_table(device: str) -> str:
    """The built-in policy's region rules: jit names and name scopes / flax module paths."""
    policy = jamp.get_policy(device)
    oplist = oplists.OPLIST_OF_DEVICE[device]
    jit_patterns = {p for p, _, _ in oplists.JIT_RULES[oplist]}
    rows = [
        (
            f"`{r.pattern}`",
            "jit-wrapped function" if r.pattern in jit_patterns else "name scope / module path",
            f"`{r.mode}`",
            _cell(r.why),
        )
        for r in policy.rules
    ]
    if not rows:
        return "_No built-in region rules: every equation follows its primitive's category._"
    return _table(("pattern", "matches", "mode", "torch.amp op / why"), rows)


def device_page(device: str) -> str:
    """The whole ``op-reference/<device>.md`` page."""
    policy = jamp.get_policy(device)
    oplist = oplists.OPLIST_OF_DEVICE[device]
    descriptions = category_descriptions()
    rows = policy_rows(device)
    n_prims = sum(len(p) for cat in rows.values() for p, _ in cat)
    title = DEVICE_TITLES.get(device, f'`device_type="{device}"`')
    lines = [
        f"# {title}",
        "",
        "<!-- Generated by docs/hooks/gen_op_reference.py from jamp.casting.oplists and jamp.get_policy(); do not edit. -->",
        "",
        f"- Compute dtype: `{policy.compute_dtype.name}` (override with `dtype=`).",
        f"- Op list: `{oplist}` ({OPLIST_NAMES.get(oplist, oplist)}), {n_prims} primitives listed.",
        f"- Region rules: {len(policy.rules)} built in (below).",
        "",
        f'Obtain it with `jamp.get_policy("{device}")`; `jamp.autocast(f, device_type="{device}")` uses it. '
        "The categories are described on [Op reference](index.md); a primitive not listed on this page "
        "is `default`: it receives exactly the input dtypes it was traced with.",
        "",
    ]
    for cat in CATEGORY_ORDER:
        if cat == oplists.Category.DEFAULT:
            continue
        lines += [f"## `{cat}`", "", _sentence(descriptions[cat]), ""]
        lines += [category_table(device, cat) if rows[cat] else "_None on this list._", ""]
    lines += [
        "## Region rules",
        "",
        "Built-in rules of this policy. A rule gives every equation under a matching path component "
        "a region mode; see [region modes](../autocast.md#region-modes). Add your own with "
        "`policy.with_rules({...})`.",
        "",
        region_rules_table(device),
        "",
    ]
    return "\n".join(lines)


def pages() -> dict[str, str]:
    """src path (relative to docs/) -> content of every generated page."""
    return {f"op-reference/{device}.md": device_page(device) for device in oplists.DEVICE_TYPES}


# -- tables embedded in hand-written pages ---------------------------------------------------------


def comparison_table() -> str:
    """One row per OP_TABLE row: its category on each device's built-in policy."""
    policies = {d: jamp.get_policy(d) for d in oplists.DEVICE_TYPES}
    rows = []
    for row in oplists.OP_TABLE:
        cats = []
        for p in policies.values():
            found = sorted({p.category(prim) for prim in row.primitives}, key=CATEGORY_ORDER.index)
            cats.append(" / ".join(f"`{c}`" for c in found))
        rows.append((_code(row.primitives), *cats, _cell(row.torch_ops)))
    header = ("JAX primitives", *(f"[{d}]({d}.md)" for d in policies), "torch.amp ops")
    return _table(header, rows)


def categories_table() -> str:
    _check_categories()
    descriptions = category_descriptions()
    return _table(
        ("category", "what the rule does"), [(f"`{c}`", _md_cell(_sentence(descriptions[c]))) for c in CATEGORY_ORDER]
    )


def region_modes_table() -> str:
    """``jamp.casting.regions.EFFECTIVE_RULE``: the rule that runs, by region mode (rows) and category (columns)."""
    _check_categories()
    modes = list(EFFECTIVE_RULE)
    if set(modes) != set(policy.MODES):
        raise RuntimeError(f"EFFECTIVE_RULE modes {modes} != jamp.casting.policy.MODES {policy.MODES}")
    rows = [(f"`{mode}`", *(f"`{EFFECTIVE_RULE[mode][c]}`" for c in CATEGORY_ORDER)) for mode in modes]
    return _table(("mode \\ category", *(f"`{c}`" for c in CATEGORY_ORDER)), rows)


def higher_order_table() -> str:
    rows = [(f"`{name}`", f"`{rule.__module__}.{rule.__qualname__}`") for name, rule in HIGHER_ORDER_RULES.items()]
    return _table(("primitive", "rule"), rows)


def torch_only_notes_table() -> str:
    return _table(("torch.amp entry", "in jamp"), [(_cell(t), _cell(n)) for t, n in oplists.TORCH_ONLY_NOTES])


def device_types_table() -> str:
    rows = []
    for device in oplists.DEVICE_TYPES:
        aliases = sorted(a for a, d in oplists.DEVICE_ALIASES.items() if d == device)
        oplist = oplists.OPLIST_OF_DEVICE[device]
        rows.append(
            (
                _code(aliases),
                f"`{oplists.DEFAULT_DTYPE_OF_DEVICE[device]}`",
                f"`{oplist}` ({OPLIST_NAMES.get(oplist, oplist)})",
                f"[{device}]({device}.md)",
            )
        )
    return _table(("device_type", "default dtype", "op list", "page"), rows)


def accumulation_table() -> str:
    """``jamp.casting.accumulation``: which primitives sum in float32 when autocast gives them a low dtype."""
    return _table(
        ("primitives", "given a float16/bfloat16 input"),
        [
            (
                _code(sorted(accumulation.WIDENED - {"broadcast_in_dim"})),
                "bound on float32, result rounded once to the dtype its rule gives: the sum (product) accumulates "
                "in float32, and so does its transpose",
            ),
            (
                "`broadcast_in_dim`",
                "bound on float32 and rounded once, when it adds elements: its transpose "
                "(a sum over the broadcast dimensions) accumulates in float32",
            ),
            (
                _code(sorted(accumulation.BROADCASTING)),
                "an operand it broadcasts (a `(1, 1, d)` bias, a rank-0 scale) is broadcast in float32 and rounded "
                "first; the op runs in the dtype its rule gives, and the gradient of that operand is summed in float32",
            ),
        ],
    )


def fp8_formats_table() -> str:
    """``jamp.casting.fp8.FORMATS``: which tensors each float8 format carries, and its range."""
    rows = []
    for fmt in fp8.FORMATS:
        info = jnp.finfo(fmt.dtype)
        rows.append(
            (
                _cell(fmt.role),
                f"`{fmt.dtype.name}`",
                str(info.nmant),
                f"{float(info.max):g}",
                f"{float(info.smallest_normal):g}",
                f"{float(info.smallest_subnormal):g}",
            )
        )
    return _table(("tensors", "dtype", "mantissa bits", "largest", "smallest normal", "smallest subnormal"), rows)


def fp8_eligibility_list() -> str:
    """The conditions of ``jamp.casting.fp8.eligible`` and the rule that applies it, with their constants."""
    modes = [m for m, rules in EFFECTIVE_RULE.items() if rules[oplists.Category.LOWER] == LeafRule.LOWER]
    return "\n".join(
        [
            (
                "- the primitive is `dot_general` and the rule of its [region mode](autocast.md#region-modes) "
                f"for `lower` ops is `lower`: modes {_code(modes)};"
            ),
            f"- both operands are {' or '.join(d.name for d in ELIGIBLE_DTYPES)};",
            "- no batch dimensions, and at least one contracting dimension;",
            (
                "- the contracted extent K and the free extents M and N (each the product of its dimensions) are "
                f"positive multiples of {fp8.ALIGNMENT}."
            ),
        ]
    )


MARKERS = {
    "accumulation": accumulation_table,
    "categories": categories_table,
    "comparison": comparison_table,
    "device-types": device_types_table,
    "fp8-eligibility": fp8_eligibility_list,
    "fp8-formats": fp8_formats_table,
    "higher-order": higher_order_table,
    "region-modes": region_modes_table,
    "torch-only-notes": torch_only_notes_table,
}


def expand_markers(markdown: str, where: str = "") -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in MARKERS:
            raise KeyError(f"{where}: unknown marker <!-- jamp:{name} -->; known: {sorted(MARKERS)}")
        return MARKERS[name]()

    return MARKER.sub(replace, markdown)


# -- mkdocs hook entry points ----------------------------------------------------------------------


def _placeholder(title: str) -> str:
    return f"# {title}\n\nThis page has not been written yet.\n"


def on_files(files, config):
    from mkdocs.structure.files import File

    for src, content in pages().items():
        files.append(File.generated(config, src, content=content))
    for src, title in PLACEHOLDERS.items():
        if files.get_file_from_path(src) is None:
            files.append(File.generated(config, src, content=_placeholder(title)))
    return files


def on_page_markdown(markdown, page, config, files):
    return expand_markers(markdown, page.file.src_uri)


def on_page_content(html, page, config, files):
    return SPHINX_ROLE.sub("", html)
