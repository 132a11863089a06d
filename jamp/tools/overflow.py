"""``jamp.find_overflow``: run the autocast program beside the float32 program, op by op, and report
the first op whose low-precision result is inf/NaN (or underflows to zero) where float32 is fine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import regions
from jamp.casting.call import Call, Context, Env, cast_outputs
from jamp.casting.interpreter import track_facts
from jamp.casting.rules import select_rule
from jamp.casting.rules.calls import jit_body_ctx
from jamp.casting.transform import autocast


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first op where autocast broke what float32 computes."""

    kind: str                  # "overflow" (inf/NaN) or "underflow" (flushed to zero)
    primitive: str
    source: str                # user file:line (function)
    path: str                  # name scopes / flax module path / jit names
    op_index: int              # position in evaluation order (sub-jaxprs included)
    input_dtypes: tuple
    output_dtype: str
    bad_elements: int
    total_elements: int
    float32_max_abs: float     # largest |value| float32 computes there: compare with the dtype's range

    def __str__(self) -> str:
        return (f"{self.kind} in {self.primitive} (op #{self.op_index}) at {self.source or '?'} "
                f"[{self.path or '<top>'}]: {self.bad_elements}/{self.total_elements} elements of its "
                f"{self.output_dtype} output, inputs {', '.join(self.input_dtypes)}; float32 max |x| "
                f"= {self.float32_max_abs:.4g}")


class _Found(Exception):
    def __init__(self, finding: Finding):
        self.finding = finding


@dataclasses.dataclass
class _Walk:
    min_underflow: float
    count: int = 0

    def compare(self, eqn, path: str, amp_in, amp_outs, ref_outs) -> None:
        self.count += 1
        for amp, ref in zip(amp_outs, ref_outs):
            if not hasattr(ref, "dtype") or not jnp.issubdtype(ref.dtype, jnp.floating):
                continue
            a, r = np.asarray(amp, np.float32), np.asarray(ref, np.float32)
            ok = np.isfinite(r)
            overflow = ok & ~np.isfinite(a)
            finding = None
            if overflow.any():
                finding = ("overflow", int(overflow.sum()))
            elif str(amp.dtype) in ("float16", "bfloat16") and self.min_underflow < 1:
                tiny = float(jnp.finfo(amp.dtype).smallest_normal)
                underflow = ok & (a == 0) & (r != 0) & (np.abs(r) < tiny)
                nonzero = max(int((r != 0).sum()), 1)
                if underflow.any() and underflow.sum() / nonzero >= self.min_underflow:
                    finding = ("underflow", int(underflow.sum()))
            if finding:
                raise _Found(Finding(
                    kind=finding[0], primitive=eqn.primitive.name, source=jc.source_location(eqn), path=path,
                    op_index=self.count, input_dtypes=tuple(str(getattr(x, "dtype", "?")) for x in amp_in),
                    output_dtype=str(amp.dtype), bad_elements=finding[1], total_elements=int(r.size),
                    float32_max_abs=float(np.abs(r[ok]).max(initial=0.0))))

    def run(self, jaxpr, consts, amp_args, ref_args, ctx: Context) -> tuple[list, list]:
        env, ref_env = Env(ctx.cache_enabled), {}
        env.write(jaxpr.constvars, consts)
        env.write(jaxpr.invars, amp_args)
        ref_env.update(zip(jaxpr.constvars, consts))
        ref_env.update(zip(jaxpr.invars, ref_args))
        ref_read = lambda v: v.val if isinstance(v, jc.Literal) else ref_env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            comps = regions.components(jc.name_stack_str(eqn))
            call = Call(eqn, [env.read(v) for v in eqn.invars], ctx.descend(comps), env, comps)
            ref_in = [ref_read(v) for v in eqn.invars]
            inline = _INLINE.get(eqn.primitive.name)
            if inline is not None:
                amp_outs, ref_outs = inline(self, call, ref_in)
                effective = eqn.primitive.name
            else:
                rule, effective = select_rule(eqn, call.ctx)
                with jc.user_context(eqn), eqn.ctx.manager:
                    amp_outs = rule(call)
                    ref_outs = eqn.primitive.bind(*ref_in, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    amp_outs, ref_outs = [amp_outs], [ref_outs]
                self.compare(eqn, "/".join(call.ctx.path), call.bound or call.invals, amp_outs, ref_outs)
            env.write(eqn.outvars, amp_outs)
            ref_env.update(zip(eqn.outvars, ref_outs))
            track_facts(env, eqn, effective)
        return [env.read(v) for v in jaxpr.outvars], [ref_read(v) for v in jaxpr.outvars]


def _inline_jit(walk: _Walk, call: Call, ref_in):
    closed = call.params[jc.JIT_JAXPR]
    return walk.run(closed.jaxpr, closed.consts, call.invals, ref_in, jit_body_ctx(call))


def _inline_remat(walk: _Walk, call: Call, ref_in):
    return walk.run(call.params[jc.REMAT_JAXPR], (), call.invals, ref_in, call.body_ctx())


def _inline_custom_jvp(walk: _Walk, call: Call, ref_in):
    closed = call.params[jc.CALL_JAXPR]
    return walk.run(closed.jaxpr, closed.consts, call.invals, ref_in, call.body_ctx())


def _inline_custom_vjp(walk: _Walk, call: Call, ref_in):
    closed = call.params[jc.CALL_JAXPR]
    amp, ref = walk.run(closed.jaxpr, closed.consts, call.cast_to_recorded(), ref_in, call.body_ctx())
    return cast_outputs(amp, [a.dtype for a in closed.out_avals]), ref


# Call-like primitives whose bodies are walked op by op; loops, branches and shard_map run whole.
_INLINE = {jc.JIT: _inline_jit, jc.REMAT: _inline_remat, jc.CUSTOM_JVP: _inline_custom_jvp,
           jc.CUSTOM_VJP: _inline_custom_vjp}


def find_overflow(fun: Callable, *, min_underflow: float = 0.01,
                  **autocast_kwargs: Any) -> Callable[..., Finding | None]:
    """``find_overflow(f, dtype=...)(*args)``: the first op of ``jamp.autocast(f)`` whose result is
    inf/NaN where float32's is finite, or (with ``min_underflow`` < 1) that flushes at least that
    fraction of its nonzero values to zero; ``None`` if there is none. Evaluates eagerly, op by op
    (jit/checkpoint/custom_jvp/custom_vjp bodies are entered; loops run whole). For a training
    step pass ``jax.value_and_grad(loss)`` to check the backward pass too."""
    if not 0 <= min_underflow <= 1:
        raise ValueError(f"min_underflow={min_underflow!r} must be in [0, 1] (1 disables underflow reports)")

    def run(*args, **kwargs) -> Finding | None:
        closed, dynamic, ctx = autocast(fun, **autocast_kwargs).trace_original(*args, **kwargs)
        try:
            _Walk(min_underflow).run(closed.jaxpr, closed.consts, dynamic, dynamic, ctx)
        except _Found as found:
            return found.finding
        return None

    return run
