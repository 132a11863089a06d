"""How a precision tool evaluates a program: its hook on the interpreter's loop, and the bodies of higher-order
primitives it evaluates itself.

Autocast's rules re-trace a body and bind the primitive with it, one path. A tool hands the interpreter
:func:`hook` instead: each first-order equation runs under its rule and is recorded; each higher-order one is
evaluated by the tool's own version of its rule (:mod:`jamp.tools.entering`), which builds the same program
with the tool's frames inside:

- every body's frame names its scope (:func:`scoped`): the observer learns that a scan body runs ``length``
  times, which branch of a cond it is in, on which devices a shard_map body runs;
- a body traced for a *threading* observer (:func:`body`) takes the shadows of its inputs after its inputs and
  returns its outputs' shadows and its reports after its outputs; the primitive is bound with the shadows
  beside the values, so both programs run in lockstep;
- reports leave a loop in its carry (:func:`loop_state`, :func:`loop_step`: the first iteration that found
  something, and what it found), a cond from every branch (zeros from those that did not run), a shard_map
  one per device (:func:`first_device` picks the device that found first);
- a call (jit, remat, custom_jvp, custom_vjp, a ``jamp.lower_precision`` call) is entered in place
  (:func:`enter`): its body is the call's value, op by op beside the shadows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.casting.call import Call, Context, cast_outputs
from jamp.casting.interpreter import evaluate
from jamp.tools.observation import Frame, Scope
from jamp.tools.pairing import pair

_LATEST = jnp.iinfo(jnp.int32).max


def hook(frame: Frame) -> Callable:
    """The interpreter's per-equation hook for an evaluation observed in ``frame``."""
    return functools.partial(_observe, frame)


def _observe(frame: Frame, call: Call, rule: Callable, effective: str) -> list:
    from jamp.tools.entering import ENTERED  # its versions of the rules evaluate bodies through this hook

    entered = ENTERED.get(call.eqn.primitive.name)
    if entered is None:
        outs, whole = rule(call), False
        outs = outs if call.eqn.primitive.multiple_results else [outs]
    else:
        outs, whole = entered(frame, call)
    frame.observer.record(call, effective, outs, frame, whole)
    return outs


def observed(jaxpr: jc.Jaxpr, consts, args, ctx: Context, frame: Frame) -> list:
    """``jaxpr``'s outputs, each equation evaluated through :func:`hook` in ``frame``."""
    return evaluate(jaxpr, consts, args, ctx, hook(frame))


def split(values: Sequence, sizes: Sequence[int]) -> list[list]:
    """``values`` cut into consecutive groups of ``sizes``, the rest last."""
    out, start = [], 0
    for n in sizes:
        out.append(list(values[start : start + n]))
        start += n
    return [*out, list(values[start:])]


def scoped(frame: Frame, kind: str, count: int | None, index: int = 0, reverse: bool = False) -> tuple:
    """The scope of a body evaluated from ``frame``: its own, with ``kind`` added."""
    return (*frame.scope, Scope(kind, count, index, reverse, frame.observer.position))


@dataclasses.dataclass
class Body:
    """A traced body; threaded: inputs ``(*values, *shadows)``, outputs ``(*values, *shadows, *reports)``."""

    closed: jc.ClosedJaxpr
    n_out: int = 0  # its own outputs
    sites: list = dataclasses.field(default_factory=list)  # the observer's note of each report it returns
    threaded: bool = False

    @property
    def report_avals(self) -> list:
        return list(self.closed.out_avals[2 * self.n_out :])

    def __call__(self, values: Sequence, shadows: Sequence) -> tuple[list, list, list]:
        """Its (outputs, shadows, reports), inlined into the trace under way."""
        outs = jc.evaluate(self.closed.jaxpr, self.closed.consts, [*values, *shadows])
        return split(outs, (self.n_out, self.n_out))


def body(frame: Frame, closed: jc.ClosedJaxpr, ctx: Context, scope: tuple, *, threads: bool = True) -> Body:
    """``closed`` traced in ``ctx`` with its output dtypes kept (loop and branch bodies), observed in a frame of
    ``scope``; with the shadows and reports of a threading observer unless ``threads`` is False."""
    out_dtypes = tuple(a.dtype for a in closed.out_avals)
    observer = frame.observer
    n, sites = len(closed.in_avals), []
    if not (threads and frame.threads):

        def run(*args):
            inner = Frame(observer, scope=scope)
            return cast_outputs(observed(closed.jaxpr, closed.consts, args, ctx, inner), out_dtypes)

        return Body(jax.make_jaxpr(run)(*closed.in_avals), len(closed.out_avals))
    shadowed = observer.shadowed(closed)

    def threaded(*args):
        inner = Frame(observer, scope=scope).child(closed.jaxpr, shadowed.consts, list(args[n:]))
        outs = cast_outputs(observed(closed.jaxpr, closed.consts, args[:n], ctx, inner), out_dtypes)
        sites[:] = [site for site, _ in inner.reports]
        return [*outs, *inner.read(closed.jaxpr.outvars, shadowed.jaxpr.outvars), *(r for _, r in inner.reports)]

    traced = jax.make_jaxpr(threaded)(*closed.in_avals, *shadowed.in_avals)
    return Body(traced, len(closed.out_avals), sites, threaded=True)


def enter(frame: Frame, call: Call, closed: jc.ClosedJaxpr, invals: list, ctx: Context, out_dtypes, shadowed=None):
    """(a call's value, whether the observer sees it whole): its body evaluated here, beside its shadows (for a
    threading observer), which run ``shadowed()`` (a float32 trace of the same code; default: the body). Shadows that cannot follow the body
    op by op (``shadowed()`` has other equations) run it whole, and the observer sees the call as one op."""
    observer, call.bound = frame.observer, invals  # what the body ran on
    if not frame.threads:
        return cast_outputs(
            observed(closed.jaxpr, closed.consts, invals, ctx, frame.child(closed.jaxpr, (), None)), out_dtypes
        ), False
    shadows = frame.read(call.eqn.invars)
    shadowed = observer.shadowed(closed) if shadowed is None else shadowed()
    if shadowed is not closed and not pair(observer, closed.jaxpr, shadowed.jaxpr):
        outs = observed(closed.jaxpr, closed.consts, invals, ctx, frame.child(closed.jaxpr, (), None))
        frame.write(call.eqn.outvars, jc.evaluate(shadowed.jaxpr, shadowed.consts, shadows))
        return cast_outputs(outs, out_dtypes), True
    inner = frame.child(closed.jaxpr, shadowed.consts, shadows)
    outs = observed(closed.jaxpr, closed.consts, invals, ctx, inner)
    frame.write(call.eqn.outvars, inner.read(closed.jaxpr.outvars, shadowed.jaxpr.outvars))
    return cast_outputs(outs, out_dtypes), False


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
