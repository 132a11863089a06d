"""A float16/bfloat16 value that autocast reads into a wider op is read as the number it holds.

XLA's default flags allow "excess precision": where a backend computes a bfloat16 op in float32 (XLA:CPU
does for most of them: float normalization), a float32 reader gets the op's unrounded result, and XLA:GPU
drops every ``convert(convert(y, float16 or bfloat16), float32)`` pair. Readers differ, so one value can be
seen rounded by one consumer and unrounded by another. A float32 program has no such seams; autocast adds
them where it reads a low-precision value in float32 (an op on the float32 list, promotion to float32, a
float32 output, a sum it widens, the scaling of a float8 operand): under
``jax.jit(jamp.autocast(...))`` a softmax cross-entropy's log-sum-exp saw the unrounded bfloat16 logits
and its gathered label logit the rounded ones, and 10% of the per-example losses came out negative.

At every such read the float32 value goes through ``lax.reduce_precision`` to the low format, an op of its
own that XLA keeps: on a value that holds a low-precision number it changes nothing, and where XLA has
dropped the rounding it rounds as the conversion would have, so every consumer sees one number.
``reduce_precision`` is linear in JAX: the identity on the tangent of a low-precision value, and on a
cotangent a rounding that the conversion back to the low dtype repeats (bfloat16: exactly the same
number; float16: see ``ROUNDING_BITS``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp.casting.dtypes import FLOAT32, is_low

# Low dtype -> (exponent bits, mantissa bits) of the reduce_precision that reads it in float32. bfloat16:
# its own format, so the reading is its exact rounding in every range. float16 keeps float32's exponent
# range: XLA's reduce_precision flushes what lies below the format's smallest normal to zero, which with
# float16's 5 exponent bits would zero float16's own subnormals. With 8 it is the identity on every float16
# number, subnormals included, and rounds an unrounded float32 value exactly as float16 does in float16's
# normal range; below 2**-14 it keeps 11 significant bits (within 2**-25 of float16's number), from 65520 on
# it stays finite where float16 is inf, and a cotangent below 2**-14 may end one float16 subnormal step
# (2**-24) from the direct rounding (rounded twice).
ROUNDING_BITS = {np.dtype(jnp.bfloat16): (8, 7), np.dtype(jnp.float16): (8, 10)}


def widen(x: Any, dtype: Any) -> Any:
    """``x``, a float16/bfloat16 array, converted to ``dtype`` (float32, or the other low dtype via
    float32) with its rounding explicit (see the module docstring)."""
    exponent_bits, mantissa_bits = ROUNDING_BITS[np.dtype(x.dtype)]
    wide = jax.lax.reduce_precision(jax.lax.convert_element_type(x, FLOAT32), exponent_bits, mantissa_bits)
    return wide if np.dtype(dtype) == FLOAT32 else jax.lax.convert_element_type(wide, dtype)


def to_float32(x: Any) -> Any:
    """A floating array in float32; a float16/bfloat16 one through :func:`widen`."""
    return widen(x, FLOAT32) if is_low(x.dtype) else jax.lax.convert_element_type(x, FLOAT32)
