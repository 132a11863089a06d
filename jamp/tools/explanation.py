"""``jamp.explain``: what ran in which dtype, where in the user's code, and which rule decided it."""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import textwrap
from collections.abc import Callable
from typing import Any

from jamp.casting.autocast import autocast
from jamp.casting.regions import LeafRule
from jamp.tools.bodies import hook
from jamp.tools.observation import Frame
from jamp.tools.records import OpRecord, Recorder
from jamp.tools.sources import fitted_source

COLUMNS = ("primitive", "ran_dtypes", "out_dtypes", "traced_dtypes", "rule", "casts", "path", "source")


@dataclasses.dataclass
class Report:
    """The result of :func:`explain`: ``rows`` (one per equation touching a float) and ``summary``.

    ``print(report)`` shows a table by module path and the summary (:meth:`to_text`); :meth:`table` gives
    a ``rich`` table, :meth:`to_dicts` and :meth:`to_csv` the rows as data.

    Attributes:
        rows: one :class:`jamp.OpRecord` per equation that takes or makes a floating value, in evaluation
            order (sub-jaxprs included).
        summary: totals over the rows: equations, matmuls and convolutions (how many, how many in low
            precision, their share of the flops in low precision and in float8), casts inserted, the
            activation bytes saved against the program as traced, and the equations inside while loops
            (whose flops count one trip).

    Examples:
        >>> import pprint, jax.numpy as jnp, jamp
        >>> a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(a, b)
        >>> pprint.pp(report.summary)  # one key a line, in order
        {'equations': 1,
         'matmul_conv_count': 1,
         'matmul_conv_low_precision': 1,
         'low_precision_flop_share': 1.0,
         'float8_flop_share': 0.0,
         'casts_inserted': 2,
         'activation_bytes_saved': 16,
         'equations_in_while_loops': 0}
    """

    rows: list[OpRecord]

    @property
    def summary(self) -> dict[str, Any]:
        """Totals over :attr:`rows`: equations, matmuls and convolutions (count, in low precision, low-precision
        and float8 share of their flops), casts inserted, activation bytes saved."""
        matmuls = [r for r in self.rows if r.flops]
        total = sum(r.flops for r in matmuls)
        return {
            "equations": len(self.rows),
            "matmul_conv_count": len(matmuls),
            "matmul_conv_low_precision": sum(r.low_precision for r in matmuls),
            "low_precision_flop_share": (sum(r.flops for r in matmuls if r.low_precision) / total) if total else 0.0,
            "float8_flop_share": (sum(r.flops for r in matmuls if r.float8) / total) if total else 0.0,
            "casts_inserted": sum(r.casts for r in self.rows),
            "activation_bytes_saved": sum(r.traced_out_bytes - r.out_bytes for r in self.rows),
            # rows in a while loop's body: their FLOPs count one iteration
            "equations_in_while_loops": sum("while" in r.scope.split(" > ") for r in self.rows),
        }

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as dicts of the :class:`jamp.OpRecord` fields, tuples of dtypes joined by ", "."""
        return [
            {k: (", ".join(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(r).items()}
            for r in self.rows
        ]

    def to_csv(self) -> str:
        """The rows as CSV text, a header of the :class:`jamp.OpRecord` fields and a line per row."""
        buf = io.StringIO()
        dicts = self.to_dicts()
        writer = csv.DictWriter(buf, fieldnames=list(dicts[0]) if dicts else list(OpRecord.__annotations__))
        writer.writeheader()
        writer.writerows(dicts)
        return buf.getvalue()

    def table(self, only_casts: bool = False, *, full: bool = False):
        """A ``rich.table.Table``: one row per module path (what ran in which dtype, and what the policy
        decided there), or with ``full=True`` one row per equation; ``only_casts`` keeps the equations
        where jamp cast an input."""
        from rich import box
        from rich.table import Table

        rows = [r for r in self.rows if r.casts or not only_casts]
        how = "one row per equation" if full else "by module path"
        table = Table(
            title=f"jamp.explain: {len(rows)} equations, {how}",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
        columns = COLUMNS if full else REGION_COLUMNS
        for column in columns:
            table.add_column(
                column,
                overflow="fold",
                no_wrap=column in _WHOLE,
                justify="right" if column in ("ops", "casts") else "left",
            )
        if full:
            for row in rows:
                d = dict(
                    zip(OpRecord.__annotations__, dataclasses.astuple(row)),
                    ran_dtypes=_ran(row),
                    source=fitted_source(row.source),
                )
                table.add_row(*(", ".join(d[c]) if isinstance(d[c], tuple) else str(d[c]) for c in columns))
            return table
        for path, group in _by_path(rows).items():
            table.add_row(
                path or "<top>",
                str(len(group)),
                _tally(d for r in group for d in _ran_floats(r)),
                _tally(r.rule for r in group if r.rule != LeafRule.PASSTHROUGH) or "-",
                str(sum(r.casts for r in group)),
                next((fitted_source(r.source).split(" (")[0] for r in group if r.source), ""),
            )
        return table

    def to_text(self, *, full: bool = False, width: int | None = None) -> str:
        """:meth:`table` and the summary as plain text, ``width`` columns wide (default: 120 by module
        path, as wide as it needs with ``full=True``)."""
        from rich.console import Console

        console = Console(file=io.StringIO(), width=width or (10_000 if full else 120), color_system=None)
        console.print(self.table(full=full))
        items = (f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in self.summary.items())
        # lines break between the items, never inside one
        lines = textwrap.wrap(", ".join(i.replace(" ", "\xa0") for i in items), width=width or 120)
        console.print("\n".join(line.replace("\xa0", " ") for line in lines), width=width or 120)
        if not full:
            console.print("report.to_text(full=True) lists every equation.")
        return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines()) + "\n"

    def __str__(self) -> str:
        return self.to_text()


# "decided": the policy's rules that ran there, without passthrough (ops that take whatever dtype arrives).
REGION_COLUMNS = ("path", "ops", "ran in", "decided", "casts", "source")
# Columns never wrapped (the others wrap at spaces, or fold): names and numbers read wrong in pieces, and a
# source's file:line cut in two points elsewhere. The source comes last, its directories cut from the left.
_WHOLE = frozenset({"primitive", "rule", "ops", "casts", "source"})
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def _by_path(rows: list[OpRecord]) -> dict[str, list[OpRecord]]:
    """Rows grouped by module path, in the order the paths first run."""
    groups: dict[str, list[OpRecord]] = {}
    for row in rows:
        groups.setdefault(row.path, []).append(row)
    return groups


def _ran(row: OpRecord) -> str:
    """The input dtypes, and where a low-precision sum accumulated: 'bfloat16 (accumulates in float32)'."""
    return ", ".join(row.ran_dtypes) + (f" (accumulates in {row.accumulated_in})" if row.accumulated_in else "")


def _ran_floats(row: OpRecord) -> set[str]:
    """The floating input dtypes, short: {'bf16'}, or {'bf16 (acc f32)'} for a sum that accumulated in float32."""
    acc = f" (acc {_SHORT[row.accumulated_in]})" if row.accumulated_in else ""
    return {
        _SHORT.get(d, d) + (acc if d in ("float16", "bfloat16") else "")
        for d in row.ran_dtypes
        if d.startswith(("float", "bfloat"))
    }


def _tally(values) -> str:
    """'f16 3, f32 1': how often each value occurs, most frequent first."""
    return ", ".join(f"{v} {n}" for v, n in collections.Counter(values).most_common())


def _touches_float(r: OpRecord) -> bool:
    return any(d.startswith(("float", "bfloat")) for d in r.arrived_dtypes + r.out_dtypes)


def explain(fun: Callable, **autocast_kwargs) -> Callable[..., Report]:
    """What ran in which dtype under :func:`jamp.autocast`, where in the user's code, and which rule decided it.

    ``explain(f, dtype=...)(*args)``: the decisions :func:`jamp.autocast` makes for ``f`` on these
    arguments, one row per equation with its source line and module path. Every body autocast enters is
    listed too (jit, checkpoint, custom derivatives, lower_precision calls, scan, while and cond bodies,
    shard_map bodies), each row with the loops and branches around it. FLOPs count what runs: a scan body's
    rows count ``length`` times (``OpRecord.repeats``), a shard_map body's once per device, a while loop's
    body once (its trip count is known only when it runs: ``Report.summary["equations_in_while_loops"]``),
    every cond branch once.

    The function is traced and rewritten as ``jamp.autocast(f, **autocast_kwargs)`` would, without running
    it; each equation that takes or makes a floating value becomes a :class:`jamp.OpRecord`: the dtypes it
    was traced with and ran on, the policy's category and the rule that decided, the casts jamp inserted.

    Args:
        fun: the function to explain, as given to :func:`jamp.autocast`.
        **autocast_kwargs (Any): the options of :func:`jamp.autocast` (``dtype``, ``device_type``, ``policy``,
            ``enabled``, ``static_argnums``, ...), as the run to explain has them.

    Returns:
        A function that takes ``fun``'s arguments and returns the :class:`jamp.Report` (nothing is run or
        compiled).

    Examples:
        >>> import jax, jax.numpy as jnp, jamp
        >>> a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(a, b)
        >>> [(row.primitive, row.ran_dtypes) for row in report.rows]  # ran in float16
        [('dot_general', ('float16', 'float16'))]
        >>> ws, x = jnp.ones((3, 16, 16)), jnp.ones((8, 16))
        >>> layer = lambda h, w: (jnp.tanh(h @ w), None)
        >>> layers = lambda ws, x: jax.lax.scan(layer, x, ws)[0]
        >>> report = jamp.explain(layers, dtype="bf16")(ws, x)
        >>> [(r.repeats, r.flops) for r in report.rows if r.flops]
        [(3, 12288)]
    """

    def run(*args, **kwargs) -> Report:
        recorder = Recorder()
        autocast(fun, **autocast_kwargs).rewrite(*args, hook=hook(Frame(recorder)), **kwargs)
        return Report([r for r in recorder.records if _touches_float(r)])

    return run
