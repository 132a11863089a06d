"""What ``jamp.find_overflow`` hooks into the interpreter: an observer that runs the float32 program beside
the autocast program, value by value, and reports every compared op's bad elements.

The interpreter evaluates the autocast program; this observer keeps, in each frame, the float32 value of
every variable beside it (its *shadow*: the reference program's value, run in lockstep through every loop
iteration and branch by the tool's versions of the higher-order rules, :mod:`jamp.tools.entering`). After each equation
that is not a higher-order one whose body was entered, it binds the equation as recorded on the shadows
and compares the two results: one report per floating output, an int32 vector ``[found, *levels, overflowed,
underflowed, nonzero in float32, float32's largest finite |x| as int32 bits]``, made by one variadic
reduction (one kernel to compile per compared output, not four).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting.call import Call
from jamp.casting.rules import HIGHER_ORDER_RULES
from jamp.tools.observation import LEVELS, Frame, Observer

_LOW = ("float16", "bfloat16")
# Ops that only move, repeat, negate or widen input elements (or take their abs or sign): an overflow,
# or an underflow share over the threshold, in their output was already in an input, which was
# compared first. They are not compared, which saves a reduction each.
_COPIES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "rev",
        "neg",
        "abs",
        "sign",
        "stop_gradient",
        "concatenate",
        "pad",
    }
)


@dataclasses.dataclass(frozen=True)
class Site:
    """One compared output, as the trace knows it; its report comes back from the compiled run."""

    primitive: str
    source: str
    path: str
    op_index: int
    input_dtypes: tuple
    output_dtype: str
    total_elements: int
    scope: tuple  # the observation.Scope entries around it

    @property
    def levels(self) -> tuple:
        """The scopes its report has a level for (loops and shard_maps), outermost first."""
        return tuple(s for s in self.scope if s.kind in LEVELS)


def _is_copy(eqn, amp_in, amp_outs) -> bool:
    """A _COPIES op, or a convert that widens (float16 -> float32 is exact)."""
    if eqn.primitive.name in _COPIES:
        return True
    return (
        eqn.primitive.name == "convert_element_type"
        and jnp.issubdtype(amp_in[0].dtype, jnp.floating)
        and jnp.issubdtype(amp_outs[0].dtype, jnp.floating)
        and jnp.finfo(amp_outs[0].dtype).bits >= jnp.finfo(amp_in[0].dtype).bits
        and jnp.finfo(amp_outs[0].dtype).nmant >= jnp.finfo(amp_in[0].dtype).nmant
    )


class Comparison(Observer):
    """find_overflow's observer: shadows are the float32 program's values; a report per compared output."""

    threads = True
    payload = 4

    def __init__(self, min_underflow: float):
        super().__init__()
        self.min_underflow = min_underflow

    def record(self, call: Call, effective: str, outs: list, frame: Frame, whole: bool) -> None:
        super().record(call, effective, outs, frame, whole)
        eqn = call.eqn
        if not frame.threads:
            return  # no shadows here: a while loop's condition
        if eqn.primitive.name in HIGHER_ORDER_RULES and not whole:
            if not frame.has(eqn.outvars):
                raise NotImplementedError(
                    f"jamp.find_overflow: the rule for {eqn.primitive.name} runs its body without the float32 "
                    "values beside it; the tool's version of the rule threads them (jamp.tools.entering)"
                )
            return  # the rule entered the body: its ops were compared there
        ref = self.shadowed(eqn)
        if ref is None:  # a conversion the float32 trace does not have (jamp.tools.pairing)
            frame.write(eqn.outvars, frame.read(eqn.invars))
        elif not whole:
            frame.write(eqn.outvars, jc.bind(ref, frame.read(eqn.invars, ref.invars)))
        amp_in = call.bound or call.invals
        if _is_copy(eqn, amp_in, outs):
            return
        for amp, ref in zip(outs, frame.read(eqn.outvars)):
            if not hasattr(ref, "dtype") or not jnp.issubdtype(ref.dtype, jnp.floating):
                continue
            check_underflow = str(amp.dtype) in _LOW and self.min_underflow < 1
            site = Site(
                primitive=eqn.primitive.name,
                source=jc.source_location(eqn),
                path="/".join(call.ctx.path),
                op_index=self.position,
                input_dtypes=tuple(str(getattr(x, "dtype", "?")) for x in amp_in),
                output_dtype=str(amp.dtype),
                total_elements=int(np.size(ref)),
                scope=frame.scope,
            )
            frame.reports.append((site, self._report(amp, ref, check_underflow)))

    def _report(self, amp, ref, check_underflow: bool):
        """``[found, overflowed, underflowed, nonzero in float32, float32's largest finite |x| (bits)]``."""
        a, r = jnp.asarray(amp, jnp.float32), jnp.asarray(ref, jnp.float32)
        ok = jnp.isfinite(r)
        under = jnp.zeros(r.shape, jnp.bool_)
        if check_underflow:
            under = ok & (a == 0) & (r != 0) & (jnp.abs(r) < float(jnp.finfo(amp.dtype).smallest_normal))
        zero = jnp.zeros((), jnp.int32)
        over, under, nonzero, top = jax.lax.reduce(
            (*(x.astype(jnp.int32) for x in (ok & ~jnp.isfinite(a), under, r != 0)), jnp.where(ok, jnp.abs(r), 0.0)),
            (zero, zero, zero, jnp.zeros((), jnp.float32)),
            lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2], jnp.maximum(x[3], y[3])),
            tuple(range(r.ndim)),
        )
        found = over > 0
        if check_underflow:
            share = under.astype(jnp.float32) >= self.min_underflow * jnp.maximum(nonzero, 1).astype(jnp.float32)
            found = found | ((under > 0) & share)
        bits = jax.lax.bitcast_convert_type(top, jnp.int32)
        return jnp.stack([found.astype(jnp.int32), over, under, nonzero, bits])
