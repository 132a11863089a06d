"""shard_map (and pmap, which stages as jit(shard_map)): boundary-preserving.

The body is an open jaxpr over per-shard avals; it can only be traced inside the manual-axis
context, so the rule hands shard_map a body function and lets shard_map trace it there.

Under a threading observer (:mod:`jamp.casting.rules.threading`) the shadows are operands and results
beside the values, under the same specs, and every report leaves once per device (its device index as a
level), out of which the caller keeps the device that found something first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jamp import _jax_compat as jc
from jamp.casting.call import Call, cast_outputs
from jamp.casting.interpreter import evaluate
from jamp.casting.observation import SHARD_MAP, Frame
from jamp.casting.rules import threading
from jamp.casting.rules.threading import first_device, split


def shard_map(call: Call):
    jaxpr = jc.shard_map_jaxpr(call.eqn)
    out_dtypes = [v.aval.dtype for v in jaxpr.outvars]
    axes = jc.shard_map_manual_axes(call.params)
    ctx = threading.scoped(call, SHARD_MAP, jc.shard_map_devices(call.eqn))
    out_specs, frame = jc.shard_map_out_specs(call.eqn), call.frame
    if not frame.threads:

        def body(*args):
            return cast_outputs(evaluate(jaxpr, (), args, ctx), out_dtypes)

        params = jc.shard_map_params(call.eqn, jc.shard_map_body(out_specs, body))
        return call.bind_with(call.cast_to_recorded(), params)

    observer, n = frame.observer, len(jaxpr.invars)
    shadowed, sites = observer.shadowed(jaxpr), []

    def threaded(*args):
        inner = Frame(observer).child(jaxpr, (), list(args[n:]))
        outs = cast_outputs(evaluate(jaxpr, (), args[:n], ctx, inner), out_dtypes)
        sites[:] = [site for site, _ in inner.reports]
        device = jax.lax.axis_index(axes).astype(jnp.int32)[None]
        rows = [jnp.concatenate([r[:1], device, r[1:]])[None] for _, r in inner.reports]
        return [*outs, *inner.read(jaxpr.outvars, shadowed.outvars), *rows]

    def all_out_specs():
        return (*out_specs, *out_specs, *(PartitionSpec(axes),) * len(sites))

    params = jc.shard_map_params(call.eqn, jc.shard_map_body(all_out_specs, threaded), len(call.eqn.invars))
    operands = [*call.cast_to_recorded(), *frame.read(call.eqn.invars)]
    outs, shadows, rows = split(list(call.bind_with(operands, params)), (len(out_dtypes),) * 2)
    frame.write(call.eqn.outvars, shadows)
    frame.reports.extend((site, first_device(r, observer.payload)) for site, r in zip(sites, rows))
    return outs
