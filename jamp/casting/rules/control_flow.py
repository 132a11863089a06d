"""scan, while and cond: boundary-preserving. Inputs are cast to the recorded dtypes and the
bodies' outputs are cast back inside the re-traced body, so loop carries and branch outputs keep
their types (JAX checks that only when it traces, not when we re-bind)."""

from __future__ import annotations

from jamp import _jax_compat as jc
from jamp.casting.call import Call
from jamp.casting.interpreter import retrace


def preserving(closed: jc.ClosedJaxpr, call: Call) -> jc.ClosedJaxpr:
    out_dtypes = tuple(a.dtype for a in closed.out_avals)
    return retrace(closed, tuple(closed.in_avals), call.body_ctx(), out_dtypes)


def scan(call: Call):
    return call.bind(call.cast_to_recorded(), **{jc.SCAN_JAXPR: preserving(call.params[jc.SCAN_JAXPR], call)})


def while_loop(call: Call):
    return call.bind(
        call.cast_to_recorded(),
        **{
            jc.WHILE_COND: preserving(call.params[jc.WHILE_COND], call),
            jc.WHILE_BODY: preserving(call.params[jc.WHILE_BODY], call),
        },
    )


def cond(call: Call):
    branches = tuple(preserving(b, call) for b in call.params[jc.COND_BRANCHES])
    return call.bind(call.cast_to_recorded(), **{jc.COND_BRANCHES: branches})
