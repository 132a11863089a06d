"""Sums that autocast runs in float16/bfloat16 accumulate in float32 and round once.

An op list says which dtype an op's inputs and result have; it never asks for a running sum in that
dtype. ``jnp.sum`` upcasts low-precision inputs for its computation, and torch's kernels accumulate
in float32 (its CPU ``sum`` of bfloat16 returns bfloat16, computed in float32). A float32 program has
no such upcast to keep: when autocast hands one of its reductions a bfloat16 value (a matmul made it),
the reduction is bound on float32 and its result rounded once to the dtype the rule gave.

The backward pass sums too: the transpose of an op that broadcasts an operand (``broadcast_in_dim``,
or ``x + bias`` broadcasting a ``(1, 1, d)`` bias) sums the cotangent over the broadcast dimensions,
in the cotangent's dtype (a Dense bias gradient is a sum over batch x sequence). A ``broadcast_in_dim``
of a low-precision value is bound on float32 and rounded after; an elementwise op gets each
low-precision operand it would broadcast already broadcast that way, so the op itself runs in the
dtype its rule gave and the transpose of the broadcast accumulates in float32.

The rule applies where autocast chooses dtypes; an op evaluated as written (``default``, region mode
``off``) keeps the dtypes the program recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jamp._jax_compat import Var
from jamp.casting import rounding
from jamp.casting.dtypes import FLOAT32, is_low

# Primitives whose result sums (or multiplies) many input elements, and broadcast_in_dim, whose transpose
# does: bound on float32, result rounded once. Max, min and sorts are exact in any dtype; matmuls and
# convolutions accumulate in float32 in the backends (their result dtype is ``preferred_element_type``);
# scatters keep their recorded dtypes (``default`` category).
ACCUMULATING = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum"})
WIDENED = ACCUMULATING | {"broadcast_in_dim"}
# Elementwise primitives that broadcast size-1 dimensions of an operand (``x + bias[None, None]``).
BROADCASTING = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem"})


def _size(shape) -> int:
    return int(np.prod(shape))


def widened_dtype(eqn: Any, invals: list) -> Any:
    """The float16/bfloat16 dtype to round a ``WIDENED`` primitive's float32 result to; None when
    ``eqn`` is bound as it is."""
    if eqn.primitive.name not in WIDENED:
        return None
    low = next((x.dtype for x in invals if is_low(getattr(x, "dtype", None))), None)
    if eqn.primitive.name == "broadcast_in_dim" and _size(eqn.outvars[0].aval.shape) == np.size(invals[0]):
        return None  # adds no elements (a reshape): its transpose sums nothing
    return low


def widened_inputs(eqn: Any, invals: list, float32_of: Callable) -> list:
    """The float32 inputs a ``WIDENED`` primitive is bound on. A broadcast only moves elements, so it may
    start from the float32 value an input was rounded from (``float32_of``): the rounded result is the
    same, one conversion fewer. A sum needs the rounded values it was given, the numbers the input's
    other consumers see (:mod:`jamp.casting.rounding`)."""
    widen = float32_of if eqn.primitive.name == "broadcast_in_dim" else rounding.to_float32
    return [widen(x) if is_low(getattr(x, "dtype", None)) else x for x in invals]


def broadcasts(eqn: Any, i: int, x: Any) -> bool:
    """Whether ``eqn``, a ``BROADCASTING`` primitive, broadcasts its variable operand ``i`` (value ``x``)."""
    return (
        eqn.primitive.name in BROADCASTING
        and isinstance(eqn.invars[i], Var)
        and np.shape(x) != eqn.outvars[0].aval.shape
    )


def broadcast_in_float32(eqn: Any, invals: list, float32_of: Callable) -> list:
    """``invals`` with every low-precision operand that ``eqn`` broadcasts replaced by its float32
    broadcast to the output shape (:func:`broadcast_to`), rounded back to its dtype."""
    if eqn.primitive.name not in BROADCASTING:
        return invals
    return [
        broadcast_to(x, eqn.outvars[0].aval.shape, x.dtype, float32_of)
        if is_low(getattr(x, "dtype", None)) and broadcasts(eqn, i, x)
        else x
        for i, x in enumerate(invals)
    ]


def broadcast_to(x: Any, shape: tuple, dtype: Any, float32_of: Callable) -> Any:
    """``x`` broadcast to ``shape`` in float32 (from ``float32_of(x)``, the float32 value it was rounded
    from if any), then rounded to ``dtype``: the same values as broadcasting ``x`` rounded to ``dtype``,
    and the transpose, a sum of the cotangent over the broadcast dimensions, runs in float32."""
    dims = tuple(range(len(shape) - np.ndim(x), len(shape)))  # numpy's alignment (rank 0: none)
    wide = float32_of(x) if x.dtype != FLOAT32 else x
    return jax.lax.convert_element_type(jax.lax.broadcast_in_dim(wide, shape, dims), dtype)
