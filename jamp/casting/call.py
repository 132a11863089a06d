"""What every rule receives: the evaluation context, the environment of values, the equation being
evaluated, and the small helpers rules share. Leaf rules import only this module; the higher-order
rules also import the evaluator they recurse into (:mod:`jamp.casting.interpreter`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import accumulation, portable_dots, regions, rounding
from jamp.casting.dtypes import FLOAT32, is_eligible, is_low
from jamp.casting.policy import Mode, Policy

MATMUL_LIKE = ("dot_general", "conv_general_dilated", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class Context:
    """Where an evaluation stands: policy, region mode, enclosing path. Hashable (cache key)."""

    policy: Policy
    mode: Mode
    path: tuple[str, ...] = ()
    cache_enabled: bool = True
    recompute: bool = False  # the rewritten bodies recompute in the backward pass (jamp.casting.recompute)

    def descend(self, comps: tuple[str, ...]) -> Context:
        policy, mode = regions.resolve(self.policy, self.mode, self.path, comps)
        return dataclasses.replace(self, policy=policy, mode=mode, path=self.path + comps)

    @property
    def compute_dtype(self) -> np.dtype:
        return self.policy.compute_dtype


def cast(x: Any, dtype) -> Any:
    """Convert ``x`` to ``dtype`` unless it already is; literals stay literals. A float16/bfloat16 value
    is read with its rounding explicit, so that XLA's excess precision cannot hand this reader another
    number than the value's other consumers see (:mod:`jamp.casting.rounding`)."""
    if x.dtype == dtype:
        return x
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np.asarray(x).astype(dtype)
    if is_low(x.dtype):
        return rounding.widen(x, dtype)
    return jax.lax.convert_element_type(x, dtype)


def is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


class Env:
    """Values of one jaxpr evaluation plus the facts rules ask about them."""

    def __init__(self, cache_enabled: bool, inputs: Sequence = ()):
        self.values: dict[Any, Any] = {}
        self._inputs = {id(x): x for x in inputs}  # the jaxpr's inputs: parameters, a loop body's slices
        self.gathered_for_matmuls: frozenset = frozenset()  # gathers' outputs only matmuls read (rules.gathers)
        self._wide: dict[int, tuple[Any, Any]] = {}  # id(low) -> (low, the wider value it stands for)
        self.lowered: set[Any] = set()  # outputs of matmuls run in the compute dtype (or reshaped)
        self.origin_size: dict[Any, int] = {}  # vars that are broadcasts/reshapes of smaller arrays
        self._casts: dict[tuple[int, Any], tuple[Any, Any]] | None = {} if cache_enabled else None
        self._rounded_from: dict[int, tuple[Any, Any]] = {}  # id(low) -> (low, the float32 value cast to it)

    def cast(self, x: Any, dtype) -> Any:
        """``cast`` with torch's cast cache: a value cast to a dtype twice is cast once."""
        if x.dtype == dtype or self._casts is None:
            return self._convert(x, dtype)
        key = (id(x), np.dtype(dtype))
        hit = self._casts.get(key)
        if hit is None or hit[0] is not x:
            hit = self._casts[key] = (x, self._convert(x, dtype))
            if x.dtype == FLOAT32:
                self._rounded_from[id(hit[1])] = (hit[1], x)
        return hit[1]

    def _convert(self, x: Any, dtype) -> Any:
        """``cast``; an input of the jaxpr (a parameter) narrowed to a low dtype is cast on the shard it has, so
        that the partitioner gathers it in that dtype (:func:`jamp._jax_compat.cast_on_shard`)."""
        if is_low(dtype) and not is_low(x.dtype) and isinstance(x, jax.Array) and self._inputs.get(id(x)) is x:
            return jc.cast_on_shard(x, dtype)
        return cast(x, dtype)

    def stands_for(self, low: Any, wide: Any) -> None:
        """``low`` is ``wide`` in a lower dtype (a gather run on the compute dtype): a matmul reading ``low`` gets
        its gradient in ``wide``'s dtype (:mod:`jamp.casting.rules.gathers`)."""
        self._wide[id(low)] = (low, wide)

    def wide_origin(self, x: Any) -> Any:
        """The wider value ``x`` stands for, else ``x``."""
        hit = self._wide.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else x

    def float32_of(self, x: Any) -> Any:
        """``x`` in float32 for ops that only move elements and round the result back to ``x``'s dtype
        (broadcasts): the float32 value this evaluation rounded to ``x``, if it did (the same numbers
        without a round trip), else ``x`` converted, with no rounding step (what is rounded after is the
        same number whether XLA kept ``x``'s rounding or not)."""
        hit = self._rounded_from.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else jax.lax.convert_element_type(x, FLOAT32)

    def size_before_broadcast(self, v: Any) -> int:
        return self.origin_size.get(v, int(np.prod(v.aval.shape)))

    def is_lowered(self, v: Any) -> bool:
        return isinstance(v, jc.Var) and v in self.lowered


@dataclasses.dataclass
class Call:
    """One equation being evaluated: what a rule receives."""

    eqn: Any
    invals: list
    ctx: Context
    env: Env
    comps: tuple[str, ...]
    bound: list | None = None  # the inputs the primitive finally ran on
    widened_to: Any = None  # float32 where bind ran a float16/bfloat16 op on float32 (accumulation; jamp.explain)

    @property
    def params(self) -> dict:
        return self.eqn.params

    def bind(self, invals=None, **param_updates):
        """Bind with these inputs; an op that would sum many float16/bfloat16 elements, in its result or
        in its transpose, runs on float32 and rounds once to that dtype (:mod:`jamp.casting.accumulation`)."""
        invals = accumulation.broadcast_in_float32(
            self.eqn, self.invals if invals is None else invals, self.env.float32_of
        )
        params = jc.bind_params(self.eqn, **param_updates)
        low = accumulation.widened_dtype(self.eqn, invals)
        if low is None:
            return self.bind_with(invals, params)
        out = self.bind_with(accumulation.widened_inputs(self.eqn, invals, self.env.float32_of), params)
        self.bound = invals  # what the op list gave it (jamp.explain); the sum itself ran in float32
        self.widened_to = FLOAT32
        return cast(out, low)

    def cast_operand(self, i: int, dtype) -> Any:
        """Input ``i`` cast to ``dtype`` for this op; an operand the op broadcasts into a low dtype is
        broadcast in float32 first, so that its gradient sums in float32 (:mod:`jamp.casting.accumulation`)."""
        x = self.invals[i]
        if is_low(dtype) and accumulation.broadcasts(self.eqn, i, x):
            return accumulation.broadcast_to(x, self.eqn.outvars[0].aval.shape, dtype, self.env.float32_of)
        return self.env.cast(x, dtype)

    def bind_with(self, invals, params: dict):
        """Bind with exactly ``params``, in the form the primitive binds with (``jc.bind_params`` of the equation,
        or a higher-order rule's own); a dot whose algorithm a platform refuses runs there in a form it accepts
        (:mod:`jamp.casting.portable_dots`). Through ``jc.bind_as``, the one place equations are bound."""
        self.bound = invals
        return portable_dots.bind(self.eqn.primitive, invals, params)

    def recorded_dtype(self, i: int):
        return self.eqn.invars[i].aval.dtype

    def body_ctx(self, *extra: str) -> Context:
        """The context for a sub-jaxpr: this equation's path, plus e.g. the jit name."""
        return self.ctx.descend(extra) if extra else self.ctx

    def cast_to_recorded(self) -> list:
        return [
            self.env.cast(x, self.recorded_dtype(i)) if is_float(x) and is_eligible(x.dtype) else x
            for i, x in enumerate(self.invals)
        ]


def cast_outputs(outs, out_dtypes):
    if out_dtypes is None:
        return outs
    return [
        cast(o, d) if is_float(o) and d is not None and jnp.issubdtype(d, jnp.floating) else o
        for o, d in zip(outs, out_dtypes)
    ]


def avals_of(values) -> tuple:
    return tuple(jax.typeof(v) for v in values)
