"""The higher-order primitives as a precision tool evaluates them: autocast's rules, built again with the tool's
frames inside (:mod:`jamp.tools.bodies`), so that the tool sees every equation of every body.

Each version makes the program autocast's rule makes (the same body contexts, the same casts at the boundary)
and, for a threading observer (``jamp.find_overflow``), the float32 program beside it: the shadows ride beside
the values (a scan's consts, carry and xs; a while loop's body consts and carry; a cond's operands, the branch
chosen by the values' index; a shard_map's operands and results under the same specs) and the reports leave
through the carry (loops), every branch's outputs (cond) or once per device (shard_map). A while loop's
condition sees no shadows: the loop stops when the values' condition says so. Calls are entered in place.
Each returns ``(outputs, whether the observer sees the equation whole)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jamp import _jax_compat as jc
from jamp.casting import lower_precision as lower_precision_calls
from jamp.casting.call import Call, avals_of, cast_outputs
from jamp.casting.rules import lower_precision as lower_precision_rule
from jamp.casting.rules.calls import jit_body_ctx
from jamp.tools.bodies import Body, body, enter, first_device, loop_state, loop_step, observed, scoped, split
from jamp.tools.observation import COND, SCAN, SHARD_MAP, WHILE, Frame


def jit(frame: Frame, call: Call):
    recorded = lower_precision_calls.recorded_call(jc.jit_jaxpr(call.eqn))
    lowered = None if recorded is None else lower_precision_rule.traced(call, recorded)
    if lowered is not None:  # a jamp.lower_precision call: its float32 trace as written beside it
        invals, closed, ctx, float32 = lowered
        return enter(frame, call, closed, invals, ctx, None, shadowed=float32)
    return enter(frame, call, jc.jit_jaxpr(call.eqn), call.invals, jit_body_ctx(call), None)


def remat(frame: Frame, call: Call):
    return enter(frame, call, jc.ClosedJaxpr(jc.remat_jaxpr(call.eqn), ()), call.invals, call.body_ctx(), None)


def custom_jvp(frame: Frame, call: Call):
    return enter(frame, call, jc.call_jaxpr(call.eqn), call.invals, call.body_ctx(), None)


def custom_vjp(frame: Frame, call: Call):
    closed = jc.call_jaxpr(call.eqn)
    out_dtypes = [a.dtype for a in closed.out_avals]
    return enter(frame, call, closed, call.cast_to_recorded(), call.body_ctx(), out_dtypes)


def _halves(body: Body) -> tuple[list, list]:
    """The avals of a threaded body's inputs, and of their shadows."""
    avals = list(body.closed.in_avals)
    return avals[: len(avals) // 2], avals[len(avals) // 2 :]


def scan(frame: Frame, call: Call):
    scope = scoped(frame, SCAN, jc.scan_length(call.eqn), reverse=jc.scan_reverse(call.eqn))
    looped_body = body(frame, jc.scan_jaxpr(call.eqn), call.body_ctx(), scope)
    ops, p = call.cast_to_recorded(), call.params
    if not looped_body.threaded:
        return call.bind(ops, **{jc.SCAN_JAXPR: looped_body.closed}), False
    sizes = jc.scan_sizes(p)
    (c, k, x), (sc, sk, sx) = split(ops, sizes), split(frame.read(call.eqn.invars), sizes)
    values, shadows = _halves(looped_body)
    (vc, vk, vx), (hc, hk, hx) = split(values, sizes), split(shadows, sizes)
    state = loop_state(looped_body)
    n_c, n_k, n_s, n_y = len(c), len(k), len(state), looped_body.n_out - len(k)

    def looped(*args):
        c, sc, k, sk, state, x, sx = split(args, (n_c, n_c, n_k, n_k, n_s, len(vx)))
        outs, shadows, reports = looped_body([*c, *k, *x], [*sc, *sk, *sx])
        return [*outs[:n_k], *shadows[:n_k], *loop_step(state, reports), *outs[n_k:], *shadows[n_k:]]

    new = jax.make_jaxpr(looped)(*vc, *hc, *vk, *hk, *avals_of(state), *vx, *hx)
    params = jc.scan_params(p, new, 2 * n_c, 2 * n_k + n_s, 2 * len(x))
    k, sk, state, y, sy = split(call.bind_with([*c, *sc, *k, *sk, *state, *x, *sx], params), (n_k, n_k, n_s, n_y))
    return _left_loop(frame, call, looped_body, [*k, *y], [*sk, *sy], state), False


def while_loop(frame: Frame, call: Call):
    cond_jaxpr, body_jaxpr, _, _ = jc.while_parts(call.eqn)
    scope, ctx = scoped(frame, WHILE, None), call.body_ctx()
    cond = body(frame, cond_jaxpr, ctx, scope, threads=False).closed
    looped_body = body(frame, body_jaxpr, ctx, scope)
    ops = call.cast_to_recorded()
    if not looped_body.threaded:
        return call.bind(ops, **{jc.WHILE_COND: cond, jc.WHILE_BODY: looped_body.closed}), False
    _, _, cond_nconsts, body_nconsts = jc.while_parts(call.eqn)
    sizes = (cond_nconsts, body_nconsts)
    (cc, bc, k), (_, sbc, sk) = split(ops, sizes), split(frame.read(call.eqn.invars), sizes)
    (vbc, vk), (hbc, hk) = (split(half, (len(bc),)) for half in _halves(looped_body))
    state = loop_state(looped_body)
    n_cc, n_bc, n_k = len(cc), len(bc), len(k)

    def test(*args):
        cc, k, _ = split(args, (n_cc, n_k))
        return jc.evaluate(cond.jaxpr, cond.consts, [*cc, *k])

    def looped(*args):
        bc, sbc, k, sk, state = split(args, (n_bc, n_bc, n_k, n_k))
        outs, shadows, reports = looped_body([*bc, *k], [*sbc, *sk])
        return [*outs, *shadows, *loop_step(state, reports)]

    carry = [*vk, *hk, *avals_of(state)]
    params = {
        **call.params,
        jc.WHILE_BODY_NCONSTS: 2 * len(bc),
        jc.WHILE_COND: jax.make_jaxpr(test)(*cond.in_avals[: len(cc)], *carry),
        jc.WHILE_BODY: jax.make_jaxpr(looped)(*vbc, *hbc, *carry),
    }
    k, sk, state = split(call.bind_with([*cc, *bc, *sbc, *k, *sk, *state], params), (n_k, n_k))
    return _left_loop(frame, call, looped_body, k, sk, state), False


def _left_loop(frame: Frame, call: Call, looped_body: Body, outs: list, shadows: list, state: list) -> list:
    """The loop's outputs; their shadows and the reports it carried out go to the caller's frame."""
    frame.write(call.eqn.outvars, shadows)
    frame.reports.extend(zip(looped_body.sites, state[1:]))
    return outs


def cond(frame: Frame, call: Call):
    branches, ctx = jc.cond_branches(call.eqn), call.body_ctx()
    bodies = [body(frame, b, ctx, scoped(frame, COND, len(branches), index=i)) for i, b in enumerate(branches)]
    ops = call.cast_to_recorded()
    if not bodies[0].threaded:
        return call.bind(ops, **{jc.COND_BRANCHES: tuple(b.closed for b in bodies)}), False
    index, *operands = ops
    shadows = frame.read(call.eqn.invars[1:])
    every = [a for b in bodies for a in b.report_avals]

    def branch(i: int):
        before = sum(len(b.sites) for b in bodies[:i])

        def run(*args):
            outs, shadows, reports = bodies[i](args[: len(operands)], args[len(operands) :])
            absent = [jc.varying_like(jnp.zeros(a.shape, a.dtype), a) for a in every]
            return [*outs, *shadows, *absent[:before], *reports, *absent[before + len(reports) :]]

        return jax.make_jaxpr(run)(*bodies[i].closed.in_avals)

    new = tuple(branch(i) for i in range(len(bodies)))
    outs, out_shadows, reports = split(
        call.bind_with([index, *operands, *shadows], {**call.params, jc.COND_BRANCHES: new}), (bodies[0].n_out,) * 2
    )
    frame.write(call.eqn.outvars, out_shadows)
    frame.reports.extend(zip([s for b in bodies for s in b.sites], reports))
    return outs, False


def shard_map(frame: Frame, call: Call):
    jaxpr, ctx = jc.shard_map_jaxpr(call.eqn), call.body_ctx()
    out_dtypes = [v.aval.dtype for v in jaxpr.outvars]
    axes, out_specs = jc.shard_map_manual_axes(call.params), jc.shard_map_out_specs(call.eqn)
    scope, observer = scoped(frame, SHARD_MAP, jc.shard_map_devices(call.eqn)), frame.observer
    if not frame.threads:

        def body_fn(*args):
            return cast_outputs(observed(jaxpr, (), args, ctx, Frame(observer, scope=scope)), out_dtypes)

        params = jc.shard_map_params(call.eqn, jc.shard_map_body(out_specs, body_fn))
        return call.bind_with(call.cast_to_recorded(), params), False

    n, shadowed, sites = len(jaxpr.invars), observer.shadowed(jaxpr), []

    def threaded(*args):
        inner = Frame(observer, scope=scope).child(jaxpr, (), list(args[n:]))
        outs = cast_outputs(observed(jaxpr, (), args[:n], ctx, inner), out_dtypes)
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
    return outs, False


ENTERED = {
    jc.JIT: jit,
    jc.REMAT: remat,
    jc.SCAN: scan,
    jc.WHILE: while_loop,
    jc.COND: cond,
    jc.CUSTOM_JVP: custom_jvp,
    jc.CUSTOM_VJP: custom_vjp,
    jc.SHARD_MAP: shard_map,
}
