"""The jaxpr interpreter: one loop that re-binds every equation under a rule.

Values in the environment may have other dtypes than the jaxpr recorded (that is the point);
each rule makes its own bind well-typed. Higher-order primitives re-trace their bodies through
this same loop (``retrace``), cached so repeated traces reuse one jaxpr object and never
recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting import portable_dots, recompute, regions
from jamp.casting.call import MATMUL_LIKE, Call, Context, Env, cast_outputs
from jamp.casting.policy import Mode, Policy

# Equations whose output keeps the "size before broadcast" of their input (bias detection).
_BROADCAST_LIKE = ("broadcast_in_dim", "reshape", "convert_element_type")
# Equations whose output is their input's elements rearranged: a matmul's result is still one after them
# (bias detection: Equinox's Linear under vmap transposes, its Conv squeezes, before adding the bias).
_REARRANGING = ("reshape", "squeeze", "expand_dims", "transpose")


# A precision tool's per-equation hook (:mod:`jamp.tools.bodies`): ``hook(call, rule, effective)`` evaluates
# the equation instead of ``rule(call)`` and returns its outputs as a list.
ToolHook = Callable[[Call, Callable, str], list]


def evaluate(jaxpr: jc.Jaxpr, consts, args, ctx: Context, hook: ToolHook | None = None) -> list:
    """The outputs of ``jaxpr`` on ``args``, every equation bound under its rule (or handed to ``hook``)."""
    from jamp.casting.rules import (  # the higher-order rules import this module
        gathers,
        select_rule,
    )

    env = Env(ctx.cache_enabled, (*consts, *args))
    env.gathered_for_matmuls = gathers.read_only_by_matmuls(jaxpr, ctx, select_rule)

    def rebind(eqn, invals: list) -> list:
        comps = regions.components(jc.name_stack_str(eqn))
        eqn_ctx = ctx.descend(comps)
        rule, effective = select_rule(eqn, eqn_ctx)
        call = Call(eqn, invals, eqn_ctx, env, comps)
        if hook is None:
            outs = rule(call)
            outs = outs if eqn.primitive.multiple_results else [outs]
        else:
            outs = hook(call, rule, effective)
        track_facts(env, eqn, effective)
        return outs

    return jc.evaluate(jaxpr, consts, args, rebind, env.values)


def track_facts(env: Env, eqn, effective: str) -> None:
    name = eqn.primitive.name
    if (name in MATMUL_LIKE and effective == "lower") or (name in _REARRANGING and env.is_lowered(eqn.invars[0])):
        env.lowered.update(eqn.outvars)
    if name in _BROADCAST_LIKE and isinstance(eqn.invars[0], jc.Var):
        env.origin_size[eqn.outvars[0]] = env.size_before_broadcast(eqn.invars[0])


def rewrite_jaxpr(
    closed: jc.ClosedJaxpr, in_avals: tuple, ctx: Context, out_dtypes: tuple | None, hook: ToolHook | None = None
) -> jc.ClosedJaxpr:
    """``closed`` evaluated on ``in_avals`` through the interpreter, staged: the rewritten program."""

    def run(*args):
        return cast_outputs(evaluate(closed.jaxpr, closed.consts, args, ctx, hook), out_dtypes)

    return jax.make_jaxpr(run)(*in_avals)


def trace_jaxpr(closed: jc.ClosedJaxpr, in_avals: tuple, ctx: Context, out_dtypes: tuple | None) -> jc.ClosedJaxpr:
    """:func:`rewrite_jaxpr`, with what the backward pass recomputes (:mod:`jamp.casting.recompute`)."""
    closed = rewrite_jaxpr(closed, in_avals, ctx, out_dtypes)
    return recompute.with_recompute(closed) if ctx.recompute else closed


_cached = jc.weakref_lru_cache(trace_jaxpr)


def retrace(closed: jc.ClosedJaxpr, in_avals: tuple, ctx: Context, out_dtypes: tuple | None) -> jc.ClosedJaxpr:
    """``closed`` re-traced through the interpreter; ``out_dtypes`` pins the output dtypes (boundary-preserving
    rules) or ``None`` lets them follow the rules (dtype-propagating rules). Cached on the body, the input types
    and the context: repeated traces reuse one jaxpr object and never recompile."""
    return _cached(closed, in_avals, ctx, out_dtypes)


@jc.weakref_lru_cache
def retrace_open(jaxpr: jc.Jaxpr, in_avals: tuple, ctx: Context) -> jc.ClosedJaxpr:
    """:func:`retrace` for an open jaxpr (remat's body)."""
    return trace_jaxpr(jc.ClosedJaxpr(jaxpr, ()), in_avals, ctx, None)


# Every equation bound as the program recorded it (region mode ``off``; a policy without region rules, so
# that no jit name switches the mode).
_AS_WRITTEN = Context(Policy(jnp.bfloat16), Mode.OFF)


def run_as_written(fun: Callable, *args, **kwargs) -> Any:
    """``fun(*args, **kwargs)``; a program holding a dot whose algorithm a platform refuses is evaluated through this
    interpreter as written, so that the dot runs there in a form it accepts (:mod:`jamp.casting.portable_dots`).
    For calls outside autocast (``jamp.nn``'s); an autocast's own evaluation binds every dot that way."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
    if not portable_dots.holds_refused(closed.jaxpr):
        return fun(*args, **kwargs)
    portable = trace_jaxpr(closed, tuple(closed.in_avals), _AS_WRITTEN, None)
    outs = jc.evaluate(portable.jaxpr, portable.consts, jax.tree.leaves((args, kwargs)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
