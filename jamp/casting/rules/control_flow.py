"""scan, while and cond: boundary-preserving. Inputs are cast to the recorded dtypes and the
bodies' outputs are cast back inside the re-traced body, so loop carries and branch outputs keep
their types (JAX checks that only when it traces, not when we re-bind)."""

from __future__ import annotations

from jamp import _jax_compat as jc
from jamp.casting.call import Call
from jamp.casting.interpreter import retrace


def preserving(closed: jc.ClosedJaxpr, ctx) -> jc.ClosedJaxpr:
    """``closed`` re-traced in ``ctx`` with the output dtypes it recorded."""
    out_dtypes = tuple(a.dtype for a in closed.out_avals)
    return retrace(closed, tuple(closed.in_avals), ctx, out_dtypes)


def scan(call: Call):
    body = preserving(jc.scan_jaxpr(call.eqn), call.body_ctx())
    return call.bind(call.cast_to_recorded(), **{jc.SCAN_JAXPR: body})


def while_loop(call: Call):
    cond_jaxpr, body_jaxpr, _, _ = jc.while_parts(call.eqn)
    ctx = call.body_ctx()
    bodies = {jc.WHILE_COND: preserving(cond_jaxpr, ctx), jc.WHILE_BODY: preserving(body_jaxpr, ctx)}
    return call.bind(call.cast_to_recorded(), **bodies)


def cond(call: Call):
    ctx = call.body_ctx()
    branches = tuple(preserving(b, ctx) for b in jc.cond_branches(call.eqn))
    return call.bind(call.cast_to_recorded(), **{jc.COND_BRANCHES: branches})
