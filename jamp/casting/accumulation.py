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

from typing import Any

import jax
import numpy as np

from jamp._jax_compat import Var
from jamp.casting.dtypes import FLOAT32, is_low

# Primitives whose result sums (or multiplies) many input elements, and broadcast_in_dim, whose transpose
# does: bound on float32, result rounded once. Max, min and sorts are exact in any dtype; matmuls and
# convolutions accumulate in float32 in the backends (their result dtype is ``preferred_element_type``);
# scatters keep their recorded dtypes (``default`` category).
WIDENED = frozenset({
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum", "broadcast_in_dim",
})
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


def broadcast_in_float32(eqn: Any, invals: list) -> list:
    """``invals`` with every low-precision variable operand that a ``BROADCASTING`` primitive would
    broadcast replaced by its float32 broadcast to the output shape, rounded back to its dtype."""
    if eqn.primitive.name not in BROADCASTING:
        return invals
    shape = eqn.outvars[0].aval.shape
    return [_broadcast(x, shape) if isinstance(v, Var) and is_low(x.dtype) and np.shape(x) != shape else x
            for v, x in zip(eqn.invars, invals)]


def _broadcast(x: Any, shape: tuple) -> Any:
    wide = jax.lax.convert_element_type(x, FLOAT32)
    dims = tuple(range(len(shape) - np.ndim(x), len(shape)))  # numpy's alignment (rank 0: none)
    return jax.lax.convert_element_type(jax.lax.broadcast_in_dim(wide, shape, dims), x.dtype)
