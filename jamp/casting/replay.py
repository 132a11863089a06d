"""Evaluating a rewritten program under an outer transformation, op by op through cached one-op jits.

``jax.core.eval_jaxpr`` binds a program equation by equation, and an outer ``grad`` then linearizes each
equation afresh (it traces the equation's JVP and partially evaluates it). jnp's functions are inline
jits, and JAX caches the linearization (and transpose) of a jit's jaxpr, so a float32 program built from
them pays once per distinct op, not once per use. Replaying the rewritten program through one cached
inline jit per distinct op (primitive, parameters, input types, literals) gets the same: the layers of
a deep model repeat each op with the same shapes, and JAX linearizes it once. Inline jits leave the outer
program flat (the compiled program is unchanged), and the inlined equation takes the source information
of the equation it replays.

Only where it pays: under a transformation that differentiates. A jit binds more slowly than its one
primitive, so a plain trace (``jax.jit`` or ``vmap`` of an autocast function) replays with ``eval_jaxpr``.
Equations with sub-programs (jit, scan, cond, custom derivatives: JAX caches those itself), with effects,
or with unhashable parameters are bound as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jamp import _jax_compat as jc

_CACHE_SIZE = 8192  # distinct ops kept compiled into one-op jits (a 48-layer transformer has a few hundred)


def run(closed: jc.ClosedJaxpr, args: list) -> list:
    """``closed`` evaluated on ``args`` (tracers of an outer transformation); literal outputs as arrays."""
    if not any(jc.is_differentiated(x) for x in args):
        outs = jc.evaluate(closed.jaxpr, closed.consts, args)
    else:
        outs = _replay(closed, args)
    # a literal output comes back as the jaxpr holds it (a Python bool, a NumPy scalar): an array, as the
    # executable returns it
    return [jax.numpy.asarray(o) if isinstance(v, jc.Literal) else o for v, o in zip(closed.jaxpr.outvars, outs)]


def _replay(closed: jc.ClosedJaxpr, args: list) -> list:
    ops = iter(_plan(closed))

    def rebind(eqn, invals: list) -> list:
        op = next(ops)
        if op is None:
            return jc.bind(eqn, invals)
        return op(*[x for v, x in zip(eqn.invars, invals) if not isinstance(v, jc.Literal)])

    return jc.evaluate(closed.jaxpr, closed.consts, args, rebind)


@jc.weakref_lru_cache
def _plan(closed: jc.ClosedJaxpr) -> tuple[Callable | None, ...]:
    """Per equation of ``closed``: its cached one-op jit, or None where it is bound as it is."""
    return tuple(_one_op(*key) if (key := _op_key(eqn)) is not None else None for eqn in closed.jaxpr.eqns)


def _op_key(eqn: Any) -> tuple | None:
    """What makes two equations the same op (a hashable key), or None for an equation bound as it is."""
    if eqn.effects or any(True for _ in jc.jaxprs_in_params(eqn.params)):
        return None
    params = tuple(sorted(eqn.params.items()))
    inputs = tuple(_Literal(jc.literal_value(v)) if isinstance(v, jc.Literal) else v.aval for v in eqn.invars)
    key = (eqn.primitive, params, inputs)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Literal:
    """A literal input in an op's key: equal to another of the same type, dtype and bits (``1``, ``1.0`` and
    ``True`` are three ops); it keeps the value the equation binds."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any):
        array = np.asarray(value)
        self.value, self._key = value, (type(value), array.dtype, array.tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Literal) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _one_op(primitive: Any, params: tuple, inputs: tuple) -> Callable:
    """An inline jit of one ``primitive`` bind; its arguments are the non-literal inputs, it returns a list."""
    avals = [spec for spec in inputs if not isinstance(spec, _Literal)]

    def op(*xs):
        it = iter(xs)
        return jc.bind_primitive(
            primitive, [spec.value if isinstance(spec, _Literal) else next(it) for spec in inputs], dict(params)
        )

    closed = jax.make_jaxpr(op)(*avals)
    return jax.jit(jc.jaxpr_as_fun(closed), inline=jc.INLINE_WHILE_TRACING)
