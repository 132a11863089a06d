"""What the higher-order rules add to the bodies they re-trace while an observer watches.

Autocast's rules re-trace a body and bind the primitive with it. Under an observer
(:mod:`jamp.casting.observation`) the same rules run, and

- every body's context names its scope (:func:`scoped`): the observer learns that a scan body runs
  ``length`` times, which branch of a cond it is in, on which devices a shard_map body runs;
- a body re-traced for a *threading* observer (:func:`body`) takes the shadows of its inputs after its
  inputs and returns its outputs' shadows and its reports after its outputs; the rule binds it with the
  shadows beside the values (scan: consts, carry and xs; while: body consts and carry; cond: operands;
  shard_map: operands and results under the same specs), so both programs run in lockstep;
- reports leave a loop in its carry (:func:`loop_state`, :func:`loop_step`: the first iteration that
  found something, and what it found), a cond from every branch (zeros from those that did not run),
  a shard_map one per device (:func:`first_device` picks the device that found first);
- a call (jit, remat, custom_jvp, custom_vjp, a ``jamp.lower_precision`` call) is entered in place
  (:func:`enter`): its body is the call's value, op by op beside the shadows.

Without an observer every helper returns what autocast binds, from the cached traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting.call import Call, Context, cast_outputs
from jamp.casting.interpreter import evaluate, retrace
from jamp.casting.observation import Frame, Scope
from jamp.casting.pairing import pair

_LATEST = jnp.iinfo(jnp.int32).max


def split(values: Sequence, sizes: Sequence[int]) -> list[list]:
    """``values`` cut into consecutive groups of ``sizes``, the rest last."""
    out, start = [], 0
    for n in sizes:
        out.append(list(values[start : start + n]))
        start += n
    return [*out, list(values[start:])]


def scoped(call: Call, kind: str, count: int | None, index: int = 0, reverse: bool = False) -> Context:
    """The context of a body of ``call``: its scope gains ``kind`` while an observer watches."""
    ctx = call.body_ctx()
    if ctx.recorder is None:
        return ctx
    scope = Scope(kind, count, index, reverse, ctx.recorder.position)
    return dataclasses.replace(ctx, scope=(*ctx.scope, scope))


@dataclasses.dataclass
class Body:
    """A re-traced body; threaded: inputs ``(*values, *shadows)``, outputs ``(*values, *shadows, *reports)``."""

    closed: jc.ClosedJaxpr
    n_out: int = 0  # its own outputs (threaded)
    sites: list | None = None  # the observer's note of each report it returns (threaded)

    @property
    def threaded(self) -> bool:
        return self.sites is not None

    @property
    def report_avals(self) -> list:
        return list(self.closed.out_avals[2 * self.n_out :])

    def __call__(self, values: Sequence, shadows: Sequence) -> tuple[list, list, list]:
        """Its (outputs, shadows, reports), inlined into the trace under way."""
        outs = jc.evaluate(self.closed.jaxpr, self.closed.consts, [*values, *shadows])
        return split(outs, (self.n_out, self.n_out))


def body(call: Call, closed: jc.ClosedJaxpr, ctx: Context, *, preserving: bool) -> Body:
    """``closed`` re-traced in ``ctx``; boundary-``preserving`` bodies keep their output dtypes."""
    out_dtypes = tuple(a.dtype for a in closed.out_avals) if preserving else None
    if not call.frame.threads:
        return Body(retrace(closed, tuple(closed.in_avals), ctx, out_dtypes))
    observer = call.frame.observer
    shadowed = observer.shadowed(closed)
    n, sites = len(closed.in_avals), []

    def run(*args):
        frame = Frame(observer).child(closed.jaxpr, shadowed.consts, list(args[n:]))
        outs = cast_outputs(evaluate(closed.jaxpr, closed.consts, args[:n], ctx, frame), out_dtypes)
        sites[:] = [site for site, _ in frame.reports]
        return [*outs, *frame.read(closed.jaxpr.outvars, shadowed.jaxpr.outvars), *(r for _, r in frame.reports)]

    traced = jax.make_jaxpr(run)(*closed.in_avals, *shadowed.in_avals)
    return Body(traced, len(closed.out_avals), sites)


def enter(call: Call, closed: jc.ClosedJaxpr, invals: list, ctx: Context, out_dtypes, bind: Callable, shadowed=None):
    """A call's value: ``bind()`` (autocast's rule) unless a threading observer watches; then the body is
    evaluated here, beside its shadows, which run ``shadowed()`` (a float32 trace of the same code; default:
    the body). Shadows that cannot follow the body op by op (``shadowed()`` has other equations) run it
    whole, and the observer sees the call as one op."""
    frame = call.frame
    if not frame.threads:
        return bind()
    observer = frame.observer
    shadows = frame.read(call.eqn.invars)
    shadowed = observer.shadowed(closed) if shadowed is None else shadowed()
    if shadowed is not closed and not pair(observer, closed.jaxpr, shadowed.jaxpr):
        outs = evaluate(closed.jaxpr, closed.consts, invals, ctx, frame.child(closed.jaxpr, (), None))
        frame.write(call.eqn.outvars, jc.evaluate(shadowed.jaxpr, shadowed.consts, shadows))
        call.whole = True
        return cast_outputs(outs, out_dtypes)
    inner = frame.child(closed.jaxpr, shadowed.consts, shadows)
    outs = evaluate(closed.jaxpr, closed.consts, invals, ctx, inner)
    frame.write(call.eqn.outvars, inner.read(closed.jaxpr.outvars, shadowed.jaxpr.outvars))
    return cast_outputs(outs, out_dtypes)


def loop_state(body: Body) -> list:
    """A loop's added carry: the iteration counter, and per report of its body the report with one more
    level, found nowhere yet."""
    zeros = [jc.varying_like(jnp.zeros((a.shape[0] + 1,), jnp.int32), a) for a in body.report_avals]
    return [jnp.zeros((), jnp.int32), *zeros]


def loop_step(state: list, reports: list) -> list:
    """``state`` after one iteration that reported ``reports``: a report that found something for the
    first time is kept, with the iteration as its new level."""
    step, *kept = state
    new = [
        jnp.where((k[0] == 0) & (r[0] != 0), jnp.concatenate([r[:1], step[None], r[1:]]), k)
        for k, r in zip(kept, reports)
    ]
    return [step + 1, *new]


def first_device(rows: Any, payload: int) -> Any:
    """Of one report per device (a row each: found, device, levels, payload), the one that found something at
    the earliest iteration (the lowest device among equals), or a row that found nothing. Reductions only:
    ``rows`` may be sharded over the devices."""
    candidate = rows[:, 0] != 0
    for j in (*range(2, rows.shape[1] - payload), 1):  # the device last: it makes the candidate unique
        best = jnp.min(jnp.where(candidate, rows[:, j], _LATEST))
        candidate = candidate & (rows[:, j] == best)
    return jnp.sum(jnp.where(candidate[:, None], rows, 0), axis=0)
