"""What crosses devices: the collectives of a compiled program, by kind and dtype, read after SPMD partitioning.

A sharded program's collectives are placed by XLA's SPMD partitioner (``jax.jit`` with shardings, shard_map)
or written in the program (``pmap``'s, shard_map's ``psum``). :func:`collectives` compiles the function with
XLA's dump options, given as compiler options of this one compilation (``xla_dump_to``,
``xla_dump_hlo_pass_re``), so nothing global changes, and reads the module right after partitioning, where
each collective's dtype is the one a GPU or TPU would send. Later passes may change it: XLA:CPU widens
float16/bfloat16 all-reduces and reduce-scatters to float32, so the final CPU program (``compiled.as_text()``)
shows float32 where a GPU sends bfloat16. A program that is not partitioned (``pmap``, one device) is read as
XLA received it.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_SHAPE = r"\w+\[[\d,]*\]"
_INSTRUCTION = re.compile(
    rf"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\((?:[^()]*)\)|{_SHAPE})(?:\{{[^}}]*\}})?\s+"
    rf"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)"
)
_ARRAY = re.compile(r"(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_HLO_DTYPES = {
    "pred": "bool",
    **{f"f{b}": f"float{b}" for b in (16, 32, 64)},
    **{f"s{b}": f"int{b}" for b in (8, 16, 32, 64)},
    **{f"u{b}": f"uint{b}" for b in (8, 16, 32, 64)},
    "bf16": "bfloat16",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
}


class Collective(NamedTuple):
    """One row of :class:`Collectives`: the collectives of one kind moving one dtype.

    Attributes:
        kind: "all-reduce", "reduce-scatter", "all-gather", "all-to-all" or "collective-permute".
        dtype: the element type they move, as numpy names it ("bfloat16", "float32", "int32").
        count: how many arrays they move in the program (each array of a tuple-shaped collective counts; one
            in a loop body counts once).
        bytes: the size on each device of the arrays they reduce or gather, summed: an all-reduce's result,
            a reduce-scatter's operand, an all-gather's result.

    Examples:
        >>> import jamp
        >>> row = jamp.Collective("all-reduce", "float32", 2, 4096)
        >>> row.kind, row.dtype
        ('all-reduce', 'float32')
    """

    kind: str
    dtype: str
    count: int
    bytes: int


class Collectives(tuple):
    """The rows :func:`jamp.collectives` returns (a tuple of :class:`jamp.Collective`), printed as a table."""

    def __str__(self) -> str:
        if not self:
            return "no collectives"
        header = ("kind", "dtype", "count", "bytes")
        rows = [header] + [(r.kind, r.dtype, str(r.count), f"{r.bytes:,}") for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def select(self, kind: str) -> dict[str, int]:
        """``{dtype: count}`` of the collectives of one kind ("all-reduce")."""
        return {r.dtype: r.count for r in self if r.kind == kind}


def collectives(fun: Callable, *args: Any, **kwargs: Any) -> Collectives:
    """The collectives of ``fun(*args, **kwargs)`` after SPMD partitioning: kind, dtype, count and bytes.

    Args:
        fun: a ``jax.jit`` or ``jax.pmap`` function (anything with ``.lower``), or a plain function, which is
            jitted. Shardings come from the arguments (``jax.device_put`` with a ``NamedSharding``) or from
            the jit's ``in_shardings``, as when the program runs.
        *args: the arguments ``fun`` is called with (arrays or ``jax.ShapeDtypeStruct`` with shardings).
        **kwargs: keyword arguments of ``fun``.

    Returns:
        A tuple of :class:`jamp.Collective` rows, sorted by kind and dtype; ``print`` shows them as a table and
        ``.select(kind)`` gives ``{dtype: count}`` of one kind.
        Read after partitioning: XLA:CPU's later passes widen bfloat16 collectives to float32, which this
        does not show, since a GPU or TPU sends them as partitioned.

    Examples:
        >>> import jax, jax.numpy as jnp, jamp
        >>> print(jamp.collectives(jax.jit(lambda x: x * 2), jnp.ones(4)))
        no collectives
    """
    lowered = (fun if hasattr(fun, "lower") else jax.jit(fun)).lower(*args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="jamp-collectives-") as dump:
        lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        paths = glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt")) or glob.glob(
            os.path.join(dump, "*before_optimizations.txt")
        )
        texts = [open(p).read() for p in sorted(paths)]
    return parse_hlo("\n".join(texts))


def parse_hlo(text: str) -> Collectives:
    """The collectives of an HLO module's text (:func:`collectives` reads the module after partitioning)."""
    shapes: dict[str, str] = {}
    found: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        shapes[m["name"]] = m["shape"]
        kind = m["op"].removesuffix("-start")
        if kind not in KINDS:
            continue
        moved = m["shape"]
        if kind == "reduce-scatter":
            operands = [shapes.get(o.strip().lstrip("%"), "") for o in m["operands"].split(",")]
            moved = " ".join(operands) or moved
        for dtype, size in _arrays(moved):
            row = found[(kind, dtype)]
            row[0] += 1
            row[1] += size
    order = {k: i for i, k in enumerate(KINDS)}
    rows = sorted(found.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))
    return Collectives(Collective(kind, dtype, count, size) for (kind, dtype), (count, size) in rows)


def _arrays(shape: str) -> list[tuple[str, int]]:
    """``(numpy dtype name, bytes)`` of each array in an HLO shape (a tuple shape holds several)."""
    out = []
    for m in _ARRAY.finditer(shape):
        dtype = _HLO_DTYPES.get(m["dtype"], m["dtype"])
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            itemsize = np.dtype(getattr(jax.numpy, dtype)).itemsize
        dims = [int(d) for d in m["dims"].split(",") if d]
        out.append((dtype, itemsize * math.prod(dims)))
    return out
