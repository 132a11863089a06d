"""A lowered matmul whose wider operands get their cotangents in ``reduce_dtype``: gradients cross devices in it.

Autocast runs ``dot(x, w)`` of a float32 parameter ``w`` as ``dot(x, cast(w))`` in the compute dtype. JAX
differentiates that into ``x^T @ ct`` in the compute dtype, cast to float32 afterwards; where the batch is
sharded that product is a partial sum, and XLA's partitioner reduces it across devices before the cast, in
bfloat16 (a ring all-reduce rounds at every hop: 3.3e-3 relative error on 8 devices, 1.8e-2 on 256). torch AMP
+ DDP all-reduces ``param.grad``, which is float32.

Here the matmul is :func:`jamp._jax_compat.wide_matmul`: the same compute-dtype dot forward, whose tangent in each
operand wider than the compute dtype is transposed into that operand's cotangent computed from compute-dtype
operands with a ``reduce_dtype`` result (``preferred_element_type``). The weight gradient's matmul still runs at
the compute dtype's speed, and its partial sums, and every reduction of them across devices (the partitioner's
all-reduce or reduce-scatter), are ``reduce_dtype``. Operands already in the compute dtype (activations) are
differentiated as before. The casts stay outside, where recompute sees them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jamp import _jax_compat as jc


def widens(dtype: Any, compute_dtype: Any, reduce_dtype: Any) -> bool:
    """Whether an operand of ``dtype`` (cast down to ``compute_dtype``) gets its cotangent in ``reduce_dtype``."""
    itemsize = np.dtype(compute_dtype).itemsize
    return np.dtype(dtype).itemsize > itemsize and np.dtype(reduce_dtype).itemsize > itemsize


def applies(params: dict) -> bool:
    """A dot whose ``precision`` names no algorithm (an algorithm fixes its own operand and result types)."""
    precision = params.get("precision")
    return precision is None or (
        isinstance(precision, tuple) and all(isinstance(p, jax.lax.Precision) for p in precision)
    )


def dot_general(low: list, given: list, params: dict, compute_dtype: Any, reduce_dtype: Any) -> Any:
    """``dot_general`` of ``low`` (the operands ``given``, cast to ``compute_dtype``), returning ``compute_dtype``;
    the cotangent of each operand ``given`` wider than ``compute_dtype`` is computed in ``reduce_dtype``.

    The casts are made outside, where recompute sees them and the backward pass keeps what it kept before (the
    compute-dtype operands, or a parameter's float32 value it casts again); the wider operands enter only for
    their tangents, which replace their casts' (``cast(t)`` is the cast's tangent)."""
    compute_dtype, reduce_dtype = np.dtype(compute_dtype), np.dtype(reduce_dtype)
    positions = tuple(i for i, x in enumerate(given) if widens(x.dtype, compute_dtype, reduce_dtype))
    return jc.wide_matmul(
        low,
        [given[i] for i in positions],
        params={**params, "preferred_element_type": compute_dtype},
        positions=positions,
        reduce_dtype=reduce_dtype,
    )
