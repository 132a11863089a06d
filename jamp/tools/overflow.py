"""``jamp.find_overflow``: run the autocast program beside the float32 program and report the first op
whose low-precision result is inf/NaN (or underflows to zero) where float32 is fine.

Both programs are traced into one jitted function that returns, for every compared op, the counts of
its bad elements, so a call costs one compile and one run of about the two forward passes plus one
reduction per op (evaluating op by op eagerly cost a dispatch and a host round trip per op). The
compiled comparison is cached per argument signature.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import regions
from jamp.casting.autocast import autocast
from jamp.casting.call import Call, Context, Env, cast_outputs
from jamp.casting.interpreter import track_facts
from jamp.casting.rules import select_rule
from jamp.casting.rules.calls import jit_body_ctx
from jamp.tools.sources import short_source

_LOW = ("float16", "bfloat16")
_CACHE_SIZE = 8  # argument signatures a find_overflow(...) function keeps compiled, oldest dropped first
# Each op rounds to its own dtype, as when it runs alone: XLA may otherwise keep a float16 value in
# float32 between fused ops and hide an overflow.
_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# XLA:CPU compiles every kernel through LLVM, and the comparison adds about a kernel per op: this
# cheaper pipeline compiled a small transformer's training step a third faster and ran it as fast
# (level 0 compiled faster still but ran 4x slower).
_CPU_COMPILER_OPTIONS = {
    **_COMPILER_OPTIONS,
    "xla_backend_optimization_level": 1,
    "xla_llvm_disable_expensive_passes": True,
}
# Ops that only move, repeat, negate or widen input elements (or take their abs or sign): an overflow,
# or an underflow share over the threshold, in their output was already in an input, which was
# compared first. They are not compared, which saves a reduction each.
_COPIES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "rev",
        "neg",
        "abs",
        "sign",
        "stop_gradient",
        "concatenate",
        "pad",
    }
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first op where autocast broke what float32 computes: what :func:`jamp.find_overflow` returns.

    ``str(finding)`` is one line: the kind, the primitive, the user's line, how many elements, and the
    largest magnitude float32 computes there.

    Attributes:
        kind: "overflow" (inf/NaN where float32 is finite) or "underflow" (flushed to zero where float32 is
            not).
        primitive: the primitive's name ("dot_general").
        source: the user's line that made the op, as ``file:line (function)``.
        path: the name scopes, flax module path and jit names around it, joined by "/" ("" at the top).
        op_index: the op's position in evaluation order (sub-jaxprs included), from 1.
        input_dtypes: the dtypes of its inputs under autocast.
        output_dtype: the dtype of the bad output.
        bad_elements: how many elements of that output are bad.
        total_elements: how many elements it has.
        float32_max_abs: the largest finite ``|value|`` float32 computes there: compare it with the dtype's
            range (65504 for float16).

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> finding = jamp.find_overflow(lambda a: a @ a, device_type="gpu")(jnp.full((2, 2), 300.0))
        >>> finding.kind, finding.primitive, finding.output_dtype
        ('overflow', 'dot_general', 'float16')
        >>> finding.bad_elements, finding.total_elements, finding.float32_max_abs  # 2 * 300 * 300
        (4, 4, 180000.0)
    """

    kind: str  # "overflow" (inf/NaN) or "underflow" (flushed to zero)
    primitive: str
    source: str  # user file:line (function)
    path: str  # name scopes / flax module path / jit names
    op_index: int  # position in evaluation order (sub-jaxprs included)
    input_dtypes: tuple
    output_dtype: str
    bad_elements: int
    total_elements: int
    float32_max_abs: float  # largest |value| float32 computes there: compare with the dtype's range

    def __str__(self) -> str:
        return (
            f"{self.kind} in {self.primitive} (op #{self.op_index}) at {short_source(self.source) or '?'} "
            f"[{self.path or '<top>'}]: {self.bad_elements}/{self.total_elements} elements of its "
            f"{self.output_dtype} output, inputs {', '.join(self.input_dtypes)}; float32 max |x| "
            f"= {self.float32_max_abs:.4g}"
        )


@dataclasses.dataclass(frozen=True)
class _Site:
    """One compared output, as the trace knows it; its counts come back from the compiled run."""

    primitive: str
    source: str
    path: str
    op_index: int
    input_dtypes: tuple
    output_dtype: str
    total_elements: int
    check_underflow: bool


def _counts(amp, ref, check_underflow: bool) -> tuple:
    """(overflowed, underflowed, nonzero in float32) as int32, and float32's largest finite |x|, in one
    variadic reduction: one kernel per compared output to compile, not four."""
    a, r = jnp.asarray(amp, jnp.float32), jnp.asarray(ref, jnp.float32)
    ok = jnp.isfinite(r)
    under = jnp.zeros(r.shape, jnp.bool_)
    if check_underflow:
        under = ok & (a == 0) & (r != 0) & (jnp.abs(r) < float(jnp.finfo(amp.dtype).smallest_normal))
    zero = jnp.zeros((), jnp.int32)
    *counts, top = jax.lax.reduce(
        (*(x.astype(jnp.int32) for x in (ok & ~jnp.isfinite(a), under, r != 0)), jnp.where(ok, jnp.abs(r), 0.0)),
        (zero, zero, zero, jnp.zeros((), jnp.float32)),
        lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2], jnp.maximum(x[3], y[3])),
        tuple(range(r.ndim)),
    )
    return jnp.stack(counts), top


def _is_copy(eqn, amp_in, amp_outs) -> bool:
    """A _COPIES op, or a convert that widens (float16 -> float32 is exact)."""
    if eqn.primitive.name in _COPIES:
        return True
    return (
        eqn.primitive.name == "convert_element_type"
        and jnp.issubdtype(amp_in[0].dtype, jnp.floating)
        and jnp.issubdtype(amp_outs[0].dtype, jnp.floating)
        and jnp.finfo(amp_outs[0].dtype).bits >= jnp.finfo(amp_in[0].dtype).bits
        and jnp.finfo(amp_outs[0].dtype).nmant >= jnp.finfo(amp_in[0].dtype).nmant
    )


@dataclasses.dataclass
class _Walk:
    """Traces the autocast and the float32 program side by side: ``sites[i]`` gets ``counts[i]`` and
    ``maxima[i]``."""

    min_underflow: float
    count: int = 0
    sites: list = dataclasses.field(default_factory=list)
    counts: list = dataclasses.field(default_factory=list)
    maxima: list = dataclasses.field(default_factory=list)

    def compare(self, eqn, path: str, amp_in, amp_outs, ref_outs) -> None:
        self.count += 1
        if _is_copy(eqn, amp_in, amp_outs):
            return
        for amp, ref in zip(amp_outs, ref_outs):
            if not hasattr(ref, "dtype") or not jnp.issubdtype(ref.dtype, jnp.floating):
                continue
            check_underflow = str(amp.dtype) in _LOW and self.min_underflow < 1
            counts, top = _counts(amp, ref, check_underflow)
            self.counts.append(counts)
            self.maxima.append(top)
            self.sites.append(
                _Site(
                    primitive=eqn.primitive.name,
                    source=jc.source_location(eqn),
                    path=path,
                    op_index=self.count,
                    input_dtypes=tuple(str(getattr(x, "dtype", "?")) for x in amp_in),
                    output_dtype=str(amp.dtype),
                    total_elements=int(np.size(ref)),
                    check_underflow=check_underflow,
                )
            )

    def first_finding(self, counts: np.ndarray, maxima: np.ndarray) -> Finding | None:
        for site, (over, under, nonzero), top in zip(self.sites, counts.tolist(), maxima.tolist()):
            if over:
                kind, bad = "overflow", over
            elif site.check_underflow and under and under / max(nonzero, 1) >= self.min_underflow:
                kind, bad = "underflow", under
            else:
                continue
            return Finding(
                kind=kind,
                primitive=site.primitive,
                source=site.source,
                path=site.path,
                op_index=site.op_index,
                input_dtypes=site.input_dtypes,
                output_dtype=site.output_dtype,
                bad_elements=bad,
                total_elements=site.total_elements,
                float32_max_abs=top,
            )
        return None

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
_INLINE = {
    jc.JIT: _inline_jit,
    jc.REMAT: _inline_remat,
    jc.CUSTOM_JVP: _inline_custom_jvp,
    jc.CUSTOM_VJP: _inline_custom_vjp,
}


def _compile(closed: jc.ClosedJaxpr, dynamic: list, ctx: Context, min_underflow: float) -> tuple[_Walk, Callable]:
    """The walk (its sites) and the compiled program returning every site's counts and maxima."""
    walk = _Walk(min_underflow)

    def side_by_side(*dynamic):
        walk.run(closed.jaxpr, closed.consts, dynamic, dynamic, ctx)
        if not walk.sites:
            return jnp.zeros((0, 3), jnp.int32), jnp.zeros((0,), jnp.float32)
        return jnp.stack(walk.counts), jnp.stack(walk.maxima)

    options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else _COMPILER_OPTIONS
    return walk, jax.jit(side_by_side).trace(*dynamic).lower().compile(options)


def find_overflow(
    fun: Callable, *, min_underflow: float = 0.01, **autocast_kwargs: Any
) -> Callable[..., Finding | None]:
    """The first op whose low-precision result is inf/NaN (or underflows to zero) where float32's is fine.

    ``find_overflow(f, dtype=...)(*args)``: the first op of ``jamp.autocast(f)`` whose result is
    inf/NaN where float32's is finite, or (with ``min_underflow`` < 1) that flushes at least that
    fraction of its nonzero values to zero; ``None`` if there is none. jit/checkpoint/custom_jvp/
    custom_vjp bodies are entered; loops run whole. The comparison is compiled once per argument
    signature and kept, so checking every N training steps costs one run each time. For a training
    step pass ``jax.value_and_grad(loss)`` to check the backward pass too.

    Both programs are traced into one jitted function that returns, for every compared op, the counts of
    its bad elements: a call costs about the two forward passes plus one reduction per op. Each op rounds
    to its own dtype, as when it runs alone.

    Args:
        fun: the function to check, as given to :func:`jamp.autocast`.
        min_underflow: the fraction (in [0, 1]) of an op's nonzero float32 values that must flush to zero
            in float16/bfloat16 for an underflow to be reported; 1 reports overflows only.
        **autocast_kwargs: the options of :func:`jamp.autocast` (``dtype``, ``device_type``, ``policy``,
            ...), as the run to check has them.

    Returns:
        A function that takes ``fun``'s arguments and returns the first :class:`jamp.Finding`, or None.

    Raises:
        ValueError: for a ``min_underflow`` outside [0, 1].

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> check = jamp.find_overflow(lambda a: a @ a, device_type="gpu")
        >>> check(jnp.ones((2, 2))) is None  # nothing overflows
        True
        >>> check(jnp.full((2, 2), 300.0)).kind  # 2 * 300 * 300 is beyond float16's 65504
        'overflow'
    """
    if not 0 <= min_underflow <= 1:
        raise ValueError(f"min_underflow={min_underflow!r} must be in [0, 1] (1 disables underflow reports)")
    amp = autocast(fun, **autocast_kwargs)
    compiled: collections.OrderedDict = collections.OrderedDict()

    def run(*args, **kwargs) -> Finding | None:
        key, dynamic = amp.call_key(*args, **kwargs)
        entry = compiled.get(key) if key is not None else None
        if entry is None:
            closed, dynamic, ctx = amp.trace_original(*args, **kwargs)
            entry = _compile(closed, dynamic, ctx, min_underflow)
            if key is not None:
                compiled[key] = entry
                if len(compiled) > _CACHE_SIZE:
                    compiled.popitem(last=False)
        walk, executable = entry
        counts, maxima = executable(*dynamic)
        return walk.first_finding(np.asarray(counts), np.asarray(maxima))

    return run
