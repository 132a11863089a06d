"""Calls wrapped with ``jamp.lower_precision``: traced again with the dtypes the region decides.

The recorded body was traced while the user's function was, with the dtypes the trace could know (the
tracing autocast's, the regions on the name stack at that point). Here the whole path is known: the
call's floating inputs get the dtype a ``lower`` op gets in this region (the compute dtype, float32 in
a ``float32`` region, the recorded dtypes in an ``off`` region), the function is traced on them, and its
body goes through the interpreter like any jit body (a jnp implementation inside follows the policy; a
kernel stays opaque, now with low-precision inputs). The outputs keep the function's dtypes, as a
matmul's do. The float32 program a tool compares it with is the function traced on the dtypes the
call recorded (``off`` mode: as written).
"""

from __future__ import annotations

import jax

from jamp import _jax_compat as jc
from jamp.casting.call import Call, avals_of, is_float
from jamp.casting.lower_precision import LowPrecisionCall, input_dtypes
from jamp.casting.policy import Mode, Policy
from jamp.casting.tracing import Tracing


@jc.weakref_lru_cache
def _traced(recorded: LowPrecisionCall, in_avals: tuple, policy: Policy, mode: Mode) -> jc.ClosedJaxpr:
    with Tracing(policy, mode):
        return jax.make_jaxpr(recorded.flat_call)(*in_avals)


def traced(call: Call, recorded: LowPrecisionCall) -> tuple | None:
    """(inputs, the function traced on their dtypes, the body's context, a function returning its trace as
    written) for the recorded call in this context; None when the function traced on these dtypes returns
    other shapes than it recorded (then the recorded body runs)."""
    ctx = call.body_ctx(jc.jit_name(call.eqn))
    dtypes = input_dtypes(
        ctx.mode, ctx.compute_dtype, [x.dtype for x in call.invals], [v.aval.dtype for v in call.eqn.invars]
    )
    invals = [call.env.cast(x, d) if is_float(x) else x for x, d in zip(call.invals, dtypes)]
    in_avals = avals_of(invals)
    closed = _traced(recorded, in_avals, ctx.policy, ctx.mode)
    if [a.shape for a in closed.out_avals] != [v.aval.shape for v in call.eqn.outvars]:
        return None
    as_written = tuple(v.aval for v in call.eqn.invars)
    return invals, closed, ctx, lambda: _traced(recorded, as_written, ctx.policy, Mode.OFF)
