"""custom_jvp and custom_vjp.

custom_jvp (jax.nn.relu, silu, ...) propagates dtypes: the primal body and the lazily built JVP
jaxpr are both re-traced with the dtypes that arrive, so activations stay in low precision and the
user's rule is still the one that differentiates.

custom_vjp preserves its boundary: the primal and fwd bodies see the recorded dtypes and return
them, so the residuals the Python bwd rule receives have the types it was written for; the bwd
rule itself runs through the interpreter and its outputs are cast back to the dtypes the original
bwd produces (JAX does not check them, and a bf16 cotangent would leak into jax.grad).
"""

from __future__ import annotations

import jax

from jamp import _jax_compat as jc
from jamp.casting.call import Call, avals_of, cast_outputs
from jamp.casting.interpreter import evaluate, retrace


def _memoized_thunk(original, build):
    memo: dict = {}

    def thunk(*flags):
        if flags not in memo:
            memo[flags] = build(*flags)
        return memo[flags]

    return jc.wrap_like(thunk, original)


def custom_jvp(call: Call):
    ctx = call.body_ctx()
    in_avals = avals_of(call.invals)
    new_call = retrace(jc.call_jaxpr(call.eqn), in_avals, ctx, None)
    out_dtypes = tuple(a.dtype for a in new_call.out_avals)
    num_consts, original = jc.custom_jvp_parts(call.eqn)
    primal_avals = in_avals[num_consts:]

    def build(*zeros):
        jaxpr, consts, out_zeros = jc.call_thunk(original, *zeros)
        tangent_avals = [a.to_tangent_aval() for a, z in zip(primal_avals, zeros) if not z]
        tangent_dtypes = [d for d, z in zip(out_dtypes, out_zeros) if not z]
        new = retrace(
            jc.ClosedJaxpr(jaxpr, consts), (*primal_avals, *tangent_avals), ctx, (*out_dtypes, *tangent_dtypes)
        )
        return new.jaxpr, new.consts, out_zeros

    params = jc.bind_params(call.eqn, **{jc.CALL_JAXPR: new_call, jc.JVP_THUNK: _memoized_thunk(original, build)})
    return call.bind_with(call.invals, params)


def _preserving(closed, ctx):
    return retrace(closed, tuple(closed.in_avals), ctx, tuple(a.dtype for a in closed.out_avals))


def _autocast_bwd(original, ctx):
    def bwd(*args):
        zeros: list = []  # per cotangent: the symbolic zero the rule returned, or None
        logs_tree: list = []  # jax >= 0.11: the tree of the rule's backward-pass logs

        def nonzero_outputs(*a):
            cts, logs = jc.split_bwd_result(jc.call_thunk(original, *a))
            zeros[:] = [c if jc.is_symbolic_zero(c) else None for c in cts]
            log_leaves, tree = jax.tree.flatten(logs)
            logs_tree[:] = [tree]
            return [c for c in cts if not jc.is_symbolic_zero(c)], log_leaves

        closed = jax.make_jaxpr(nonzero_outputs)(*avals_of(args))
        n = zeros.count(None)
        outs = evaluate(closed.jaxpr, closed.consts, args, ctx)
        vals = iter(cast_outputs(outs[:n], [a.dtype for a in closed.out_avals[:n]]))
        cts = [z if z is not None else next(vals) for z in zeros]
        return jc.join_bwd_result(cts, jax.tree.unflatten(logs_tree[0], outs[n:]))

    return jc.wrap_like(bwd, original)


def custom_vjp(call: Call):
    ctx, operands = call.body_ctx(), call.cast_to_recorded()
    fwd_original, bwd = jc.custom_vjp_parts(call.eqn)

    def build_fwd(*nonzeros):
        jaxpr, consts = jc.call_thunk(fwd_original, *nonzeros)
        new = _preserving(jc.ClosedJaxpr(jaxpr, consts), ctx)
        return new.jaxpr, new.consts

    updates = {
        jc.CALL_JAXPR: _preserving(jc.call_jaxpr(call.eqn), ctx),
        jc.FWD_THUNK: _memoized_thunk(fwd_original, build_fwd),
        jc.BWD: _autocast_bwd(bwd, ctx),
    }
    return call.bind_with(operands, jc.bind_params(call.eqn, **updates))
