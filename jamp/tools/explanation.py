"""``jamp.explain``: what ran in which dtype, where in the user's code, and which rule decided it."""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import math
import textwrap
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting import accumulation, oplists
from jamp.casting.autocast import autocast
from jamp.casting.call import MATMUL_LIKE, Call
from jamp.casting.observation import COND, SCAN, SHARD_MAP, WHILE, Observer
from jamp.tools.sources import fitted_source


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One equation of the rewritten program: a row of :class:`jamp.Report`.

    Attributes:
        primitive: the primitive's name ("dot_general").
        source: the user's line that made the equation, as ``file:line (function)``.
        path: the name scopes, flax module path and jit names around it, joined by "/" ("" at the top).
        traced_dtypes: the input dtypes as the function was traced.
        arrived_dtypes: the input dtypes that reached the equation under autocast.
        ran_dtypes: the input dtypes the primitive ran on, after jamp's casts.
        accumulated_in: "float32" for a float16/bfloat16 sum that accumulated in float32, else "".
        out_dtypes: the output dtypes under autocast.
        traced_out_dtypes: the output dtypes as the function was traced.
        category: the policy's category of the primitive ("lower", "float32", "promote", ...).
        rule: the rule that ran (after region modes).
        mode: the region mode in force ("autocast" outside any region rule).
        casts: how many inputs jamp cast for this equation.
        flops: multiply-adds x 2 for matmuls and convolutions, else 0.
        out_bytes: bytes of the floating outputs under autocast.
        traced_out_bytes: bytes of the floating outputs as traced.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> row = report.rows[0]
        >>> row.primitive, row.traced_dtypes, row.ran_dtypes, row.rule, row.casts, row.flops
        ('dot_general', ('float32', 'float32'), ('float16', 'float16'), 'lower', 2, 48)
    """

    primitive: str
    source: str  # user file:line (function)
    path: str  # name scopes / flax module path / jit names
    traced_dtypes: tuple  # input dtypes as the function was traced
    arrived_dtypes: tuple  # input dtypes that reached the equation under autocast
    ran_dtypes: tuple  # input dtypes the primitive ran on, after jamp's casts
    accumulated_in: str  # "float32" for a float16/bfloat16 sum that accumulated in float32, else ""
    out_dtypes: tuple
    traced_out_dtypes: tuple
    category: str  # the policy's category of the primitive
    rule: str  # the rule that ran (after region modes)
    mode: str  # the region mode in force
    casts: int  # inputs jamp cast for this equation
    flops: int  # multiply-adds x 2 for matmuls and convolutions, times repeats; else 0
    out_bytes: int
    traced_out_bytes: int
    # times it runs per call, as far as the program says: the product of the enclosing scans' lengths (and
    # shard_maps' devices); a while loop's body counts once (its trip count is known only when it runs)
    repeats: int = 1
    scope: str = ""  # the loops, branches and shard_maps around it: "scan length 3 > cond branch 1", "while"

    @property
    def low_precision(self) -> bool:
        """Whether the primitive ran on a float16, bfloat16 or float8 input."""
        return self.float8 or any(d in ("float16", "bfloat16") for d in self.ran_dtypes)

    @property
    def float8(self) -> bool:
        """Whether the primitive ran on a float8 input."""
        return any(d.startswith("float8") for d in self.ran_dtypes)


def _dtypes(values) -> tuple:
    return tuple(str(getattr(v, "dtype", type(v).__name__)) for v in values)


def _flops(eqn) -> int:
    name = eqn.primitive.name
    if name not in MATMUL_LIKE:
        return 0
    out = math.prod(eqn.outvars[0].aval.shape)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * out * math.prod(rhs) // rhs[out_feature_dim]
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    return 2 * out * math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)


def _nbytes(avals_or_values) -> int:
    """Bytes of the floating values (activations); keys, ints and bools are not what AMP saves."""
    return sum(
        math.prod(a.shape) * a.dtype.itemsize
        for a in avals_or_values
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
    )


# How each scope reads in OpRecord.scope.
_SCOPE_WORDS = {
    SCAN: lambda s: f"scan length {s.count}",
    WHILE: lambda s: "while",
    COND: lambda s: f"cond branch {s.index}",
    SHARD_MAP: lambda s: f"shard_map on {s.count} device{'s' if s.count != 1 else ''}",
}


def _repeats(scope: tuple) -> int:
    """Runs per call: scans run their body ``length`` times, shard_maps on every device; a while loop's
    trip count is unknown (its body counts once), a cond's branch counts as if it ran."""
    return math.prod(s.count for s in scope if s.kind in (SCAN, SHARD_MAP))


class Recorder(Observer):
    """Collects an OpRecord for every equation the interpreter evaluates. Hashed by identity."""

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []

    def record(self, call: Call, effective: str, outs: list) -> None:
        super().record(call, effective, outs)
        eqn, scope = call.eqn, call.ctx.scope
        repeats = _repeats(scope)
        ran = call.bound if call.bound is not None else call.invals
        self.records.append(
            OpRecord(
                primitive=eqn.primitive.name,
                source=jc.source_location(eqn),
                path="/".join(call.ctx.path),
                traced_dtypes=tuple(str(v.aval.dtype) for v in eqn.invars),
                arrived_dtypes=_dtypes(call.invals),
                ran_dtypes=_dtypes(ran),
                accumulated_in=(
                    str(call.widened_to)
                    if call.widened_to is not None and eqn.primitive.name in accumulation.ACCUMULATING
                    else ""
                ),
                out_dtypes=_dtypes(outs),
                traced_out_dtypes=tuple(str(v.aval.dtype) for v in eqn.outvars),
                category=call.ctx.policy.category(eqn.primitive.name),
                rule=effective,
                mode=call.ctx.mode,
                casts=sum(getattr(a, "dtype", None) != getattr(b, "dtype", None) for a, b in zip(call.invals, ran)),
                flops=_flops(eqn) * repeats,
                out_bytes=_nbytes(outs),
                traced_out_bytes=_nbytes([v.aval for v in eqn.outvars]),
                repeats=repeats,
                scope=" > ".join(_SCOPE_WORDS[s.kind](s) for s in scope),
            )
        )


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
            precision, their share of the flops in low precision and in float8), casts inserted, and the
            activation bytes saved against the program as traced.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> report.summary
        {'equations': 1, 'matmul_conv_count': 1, 'matmul_conv_low_precision': 1, 'low_precision_flop_share': 1.0, 'float8_flop_share': 0.0, 'casts_inserted': 2, 'activation_bytes_saved': 16}
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
                _tally(r.rule for r in group if r.rule != oplists.PASSTHROUGH) or "-",
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
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> [(row.primitive, row.ran_dtypes) for row in report.rows]  # the matmul ran in float16
        [('dot_general', ('float16', 'float16'))]
        >>> ws, x = jnp.ones((3, 16, 16)), jnp.ones((8, 16))
        >>> layers = lambda ws, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        >>> [(r.repeats, r.flops) for r in jamp.explain(layers, dtype="bf16")(ws, x).rows if r.flops]
        [(3, 12288)]
    """

    def run(*args, **kwargs) -> Report:
        recorder = Recorder()
        autocast(fun, **autocast_kwargs).rewrite(*args, recorder=recorder, **kwargs)
        return Report([r for r in recorder.records if _touches_float(r)])

    return run
