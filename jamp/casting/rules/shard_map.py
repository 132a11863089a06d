"""shard_map (and pmap, which stages as jit(shard_map)): boundary-preserving.

The body is an open jaxpr over per-shard avals; it can only be traced inside the manual-axis
context, so the rule hands shard_map a body function and lets shard_map trace it there."""

from __future__ import annotations

from jamp import _jax_compat as jc
from jamp.casting.call import Call, cast_outputs
from jamp.casting.interpreter import evaluate


def shard_map(call: Call):
    jaxpr = call.params[jc.SHARD_MAP_JAXPR]
    out_dtypes = [v.aval.dtype for v in jaxpr.outvars]
    ctx = call.body_ctx()

    def body(*args):
        return cast_outputs(evaluate(jaxpr, (), args, ctx), out_dtypes)

    params = call.eqn.primitive.get_bind_params(call.params)
    params["subfuns"] = (jc.shard_map_body(call.params[jc.SHARD_MAP_OUT_SPECS], body),)
    return call.bind_with(call.cast_to_recorded(), params)
