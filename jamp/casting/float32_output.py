"""A matmul that returns its float32 accumulator from compute-dtype operands, differentiated in the
compute dtype.

``jax.nn.dot_product_attention`` asks its logits einsum for a float32 result from low-precision q and k
(a softmax exponentiates the logits, so their rounding would not stay small). Bound as is, JAX
differentiates that matmul into products of the float32 cotangent with the other operand, float32 x
bfloat16, which XLA runs as float32 matmuls: the backward pass of every attention layer would hold two
float32 matmuls. Here the tangent matmuls take the tangent rounded to the compute dtype and emit that
dtype, so the transposes (the backward matmuls) run in the compute dtype, as those of every other
lowered matmul do, and as flash attention's backward does (it computes the logits' gradient in float32
and multiplies it in bfloat16).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jamp.casting import portable_dots
from jamp.casting.dtypes import FLOAT32


def bilinear_float32_output(primitive: Any, params: dict, compute_dtype: Any) -> Any:
    """``f(lhs, rhs)``: ``primitive`` (a matmul or convolution, bilinear in its two operands) returning
    float32, whose derivative is computed with compute-dtype tangents and products."""
    # bound as every matmul jamp binds: portable to the platforms that refuse a dot algorithm in ``params``
    exact = functools.partial(_bind, primitive, {**params, "preferred_element_type": FLOAT32})
    low = functools.partial(_bind, primitive, {**params, "preferred_element_type": compute_dtype})

    @jax.custom_jvp
    def matmul(lhs, rhs):
        return exact(lhs, rhs)

    @matmul.defjvp
    def matmul_jvp(primals, tangents):
        lhs, rhs = primals
        d_lhs, d_rhs = (t.astype(compute_dtype) for t in tangents)
        tangent = low(d_lhs, rhs).astype(FLOAT32) + low(lhs, d_rhs).astype(FLOAT32)
        # the primal as a plain matmul, not a nested custom_jvp call, so that remat policies see a dot
        return exact(lhs, rhs), tangent

    return matmul


def _bind(primitive: Any, params: dict, *operands) -> Any:
    return portable_dots.bind(primitive, list(operands), params)
