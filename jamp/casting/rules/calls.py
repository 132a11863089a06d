"""jit and remat: dtype-propagating. Their bodies are re-traced with the dtypes that arrive, so
low-precision activations flow through nested jits and checkpointed blocks without boundary casts;
arity is unchanged, so shardings, donation and remat policies stay valid. A jit that records a
``jamp.lower_precision`` call is traced again from its function (:mod:`jamp.casting.rules.lower_precision`)."""

from __future__ import annotations

import dataclasses

from jamp import _jax_compat as jc
from jamp.casting import lower_precision as lower_precision_calls
from jamp.casting import oplists
from jamp.casting.call import Call, avals_of
from jamp.casting.interpreter import retrace, retrace_open
from jamp.casting.policy import Mode, Policy
from jamp.casting.rules import lower_precision as lower_precision_rule


@jc.weakref_lru_cache
def _holds_linalg(jaxpr: jc.Jaxpr, policy: Policy) -> bool:
    return any(policy.category(e.primitive.name) == oplists.Category.LINALG for e in jaxpr.eqns)


def jit_body_ctx(call: Call):
    """The jit's name is a path component (region rules match it); a jit that directly holds a
    decomposition (jnp.linalg.solve/inv/pinv...) runs in float32, matmuls around it included."""
    ctx = call.body_ctx(jc.jit_name(call.eqn))
    if ctx.mode != Mode.OFF and _holds_linalg(jc.jit_jaxpr(call.eqn).jaxpr, ctx.policy):
        ctx = dataclasses.replace(ctx, mode=Mode.FLOAT32)
    return ctx


def jit(call: Call):
    recorded = lower_precision_calls.recorded_call(jc.jit_jaxpr(call.eqn))
    lowered = None if recorded is None else lower_precision_rule.traced(call, recorded)
    if lowered is not None:  # a jamp.lower_precision call: the function, traced in this region's dtypes
        invals, closed, ctx, _ = lowered
        return call.bind(invals, **{jc.JIT_JAXPR: retrace(closed, avals_of(invals), ctx, None)})
    ctx, closed = jit_body_ctx(call), jc.jit_jaxpr(call.eqn)
    return call.bind(**{jc.JIT_JAXPR: retrace(closed, avals_of(call.invals), ctx, None)})


def remat(call: Call):
    new = retrace_open(jc.remat_jaxpr(call.eqn), avals_of(call.invals), call.body_ctx())
    body = jc.convert_constvars_jaxpr(new.jaxpr) if new.consts else new.jaxpr
    return call.bind([*new.consts, *call.invals], **{jc.REMAT_JAXPR: body})
