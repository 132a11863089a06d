"""What :func:`jamp.explain` records of each equation the interpreter evaluates: :class:`OpRecord`, and the
observer that makes them."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting import accumulation
from jamp.casting.call import MATMUL_LIKE, Call
from jamp.tools.observation import COND, SCAN, SHARD_MAP, WHILE, Frame, Observer


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
        flops: multiply-adds x 2 for matmuls and convolutions, times ``repeats``, else 0.
        out_bytes: bytes of the floating outputs under autocast (one run).
        traced_out_bytes: bytes of the floating outputs as traced (one run).
        repeats: how many times the equation runs per call: a scan body's ``length`` (nested scans multiply),
            a shard_map body's device count; 1 in a while loop's body (its trip count is not known before it
            runs) and in each cond branch (counted as if it ran).
        scope: the loops, branches and shard_maps around it, in words ("scan length 3 > cond branch 1").

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
        >>> report = jamp.explain(lambda a, b: a @ b, device_type="gpu")(a, b)
        >>> row = report.rows[0]
        >>> row.primitive, row.traced_dtypes, row.ran_dtypes
        ('dot_general', ('float32', 'float32'), ('float16', 'float16'))
        >>> row.rule, row.casts, row.flops
        ('lower', 2, 48)
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

    def record(self, call: Call, effective: str, outs: list, frame: Frame, whole: bool) -> None:
        super().record(call, effective, outs, frame, whole)
        eqn, scope = call.eqn, frame.scope
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
                category=str(call.ctx.policy.category(eqn.primitive.name)),
                rule=str(effective),
                mode=str(call.ctx.mode),
                casts=sum(getattr(a, "dtype", None) != getattr(b, "dtype", None) for a, b in zip(call.invals, ran)),
                flops=_flops(eqn) * repeats,
                out_bytes=_nbytes(outs),
                traced_out_bytes=_nbytes([v.aval for v in eqn.outvars]),
                repeats=repeats,
                scope=" > ".join(_SCOPE_WORDS[s.kind](s) for s in scope),
            )
        )
