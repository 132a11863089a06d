"""shard_map (and pmap, which stages as jit(shard_map)): boundary-preserving.

The body is an open jaxpr over per-shard avals; it can only be traced inside the manual-axis
context, so the rule hands shard_map a body function and lets shard_map trace it there."""

from __future__ import annotations

from jamp import _jax_compat as jc
from jamp.casting.call import Call, cast_outputs
from jamp.casting.interpreter import evaluate


def shard_map(call: Call):
    jaxpr, ctx = jc.shard_map_jaxpr(call.eqn), call.body_ctx()
    out_dtypes = [v.aval.dtype for v in jaxpr.outvars]

    def body(*args):
        return cast_outputs(evaluate(jaxpr, (), args, ctx), out_dtypes)

    params = jc.shard_map_params(call.eqn, jc.shard_map_body(jc.shard_map_out_specs(call.eqn), body))
    return call.bind_with(call.cast_to_recorded(), params)
