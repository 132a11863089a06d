"""scan, while and cond: boundary-preserving. Inputs are cast to the recorded dtypes and the
bodies' outputs are cast back inside the re-traced body, so loop carries and branch outputs keep
their types (JAX checks that only when it traces, not when we re-bind).

Under a threading observer (:mod:`jamp.casting.rules.threading`) the shadows ride beside the values
(a scan's consts, carry and xs; a while loop's body consts and carry; a cond's operands, the branch
chosen by the values' index) and the reports leave through the carry (loops) or every branch's
outputs (cond). A while loop's condition sees no shadows: the loop stops when the values' condition
says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting.call import Call, avals_of
from jamp.casting.interpreter import retrace
from jamp.casting.observation import COND, SCAN, WHILE
from jamp.casting.rules import threading
from jamp.casting.rules.threading import Body, loop_state, loop_step, split


def preserving(closed: jc.ClosedJaxpr, ctx) -> jc.ClosedJaxpr:
    out_dtypes = tuple(a.dtype for a in closed.out_avals)
    return retrace(closed, tuple(closed.in_avals), ctx, out_dtypes)


def _halves(body: Body) -> tuple[list, list]:
    """The avals of a threaded body's inputs, and of their shadows."""
    avals = list(body.closed.in_avals)
    return avals[: len(avals) // 2], avals[len(avals) // 2 :]


def scan(call: Call):
    p = call.params
    ctx = threading.scoped(call, SCAN, jc.scan_length(call.eqn), reverse=jc.scan_reverse(call.eqn))
    body = threading.body(call, jc.scan_jaxpr(call.eqn), ctx, preserving=True)
    ops = call.cast_to_recorded()
    if not body.threaded:
        return call.bind(ops, **{jc.SCAN_JAXPR: body.closed})
    sizes = jc.scan_sizes(p)
    (c, k, x), (sc, sk, sx) = split(ops, sizes), split(call.frame.read(call.eqn.invars), sizes)
    values, shadows = _halves(body)
    (vc, vk, vx), (hc, hk, hx) = split(values, sizes), split(shadows, sizes)
    state = loop_state(body)
    n_c, n_k, n_s, n_y = len(c), len(k), len(state), body.n_out - len(k)

    def looped(*args):
        c, sc, k, sk, state, x, sx = split(args, (n_c, n_c, n_k, n_k, n_s, len(vx)))
        outs, shadows, reports = body([*c, *k, *x], [*sc, *sk, *sx])
        return [*outs[:n_k], *shadows[:n_k], *loop_step(state, reports), *outs[n_k:], *shadows[n_k:]]

    new = jax.make_jaxpr(looped)(*vc, *hc, *vk, *hk, *avals_of(state), *vx, *hx)
    params = jc.scan_params(p, new, 2 * n_c, 2 * n_k + n_s, 2 * len(x))
    k, sk, state, y, sy = split(call.bind_with([*c, *sc, *k, *sk, *state, *x, *sx], params), (n_k, n_k, n_s, n_y))
    return _left_loop(call, body, [*k, *y], [*sk, *sy], state)


def while_loop(call: Call):
    cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts = jc.while_parts(call.eqn)
    ctx = threading.scoped(call, WHILE, None)
    cond = preserving(cond_jaxpr, ctx)
    body = threading.body(call, body_jaxpr, ctx, preserving=True)
    ops = call.cast_to_recorded()
    if not body.threaded:
        return call.bind(ops, **{jc.WHILE_COND: cond, jc.WHILE_BODY: body.closed})
    sizes = (cond_nconsts, body_nconsts)
    (cc, bc, k), (_, sbc, sk) = split(ops, sizes), split(call.frame.read(call.eqn.invars), sizes)
    (vbc, vk), (hbc, hk) = (split(half, (len(bc),)) for half in _halves(body))
    state = loop_state(body)
    n_cc, n_bc, n_k = len(cc), len(bc), len(k)

    def test(*args):
        cc, k, _ = split(args, (n_cc, n_k))
        return jc.evaluate(cond.jaxpr, cond.consts, [*cc, *k])

    def looped(*args):
        bc, sbc, k, sk, state = split(args, (n_bc, n_bc, n_k, n_k))
        outs, shadows, reports = body([*bc, *k], [*sbc, *sk])
        return [*outs, *shadows, *loop_step(state, reports)]

    carry = [*vk, *hk, *avals_of(state)]
    params = {
        **call.params,
        jc.WHILE_BODY_NCONSTS: 2 * len(bc),
        jc.WHILE_COND: jax.make_jaxpr(test)(*cond.in_avals[: len(cc)], *carry),
        jc.WHILE_BODY: jax.make_jaxpr(looped)(*vbc, *hbc, *carry),
    }
    k, sk, state = split(call.bind_with([*cc, *bc, *sbc, *k, *sk, *state], params), (n_k, n_k))
    return _left_loop(call, body, k, sk, state)


def _left_loop(call: Call, body: Body, outs: list, shadows: list, state: list) -> list:
    """The loop's outputs; their shadows and the reports it carried out go to the caller's frame."""
    call.frame.write(call.eqn.outvars, shadows)
    call.frame.reports.extend(zip(body.sites, state[1:]))
    return outs


def cond(call: Call):
    branches = jc.cond_branches(call.eqn)
    bodies = [
        threading.body(call, b, threading.scoped(call, COND, len(branches), index=i), preserving=True)
        for i, b in enumerate(branches)
    ]
    ops = call.cast_to_recorded()
    if not bodies[0].threaded:
        return call.bind(ops, **{jc.COND_BRANCHES: tuple(b.closed for b in bodies)})
    index, *operands = ops
    shadows = call.frame.read(call.eqn.invars[1:])
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
    call.frame.write(call.eqn.outvars, out_shadows)
    call.frame.reports.extend(zip([s for b in bodies for s in b.sites], reports))
    return outs
