"""Rounding float32 values onto the values of float16 or bfloat16, in float32 arithmetic.

``x.astype(bfloat16).astype(float32)`` is the obvious way to round, and the wrong one for compensated
arithmetic: with ``xla_allow_excess_precision`` (on by default) XLA may fold a narrowing-then-widening pair
into nothing (XLA:GPU does, openxla/xla#41605; XLA:CPU here drops the rounding of
``jit(lambda g: (-0.1 * g).astype(float32))`` for a bfloat16 ``g``), so ``s - round(s)`` becomes 0 and a
Kahan buffer silently stays empty. Here the rounding is float32 arithmetic that no
compiler may drop: scale ``x`` by a power of two so that the target format's spacing at ``x`` becomes 1,
round (or floor) to an integer, scale back. Every step is exact in float32, so :func:`nearest` equals
the cast bit for bit (ties to even, overflow to inf, subnormals of the target format included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jamp._floats import exact_pow2

_F32_BIAS, _F32_MANTISSA = 127, 23


def _times_pow2(x: jax.Array, n: jax.Array) -> jax.Array:
    """``x * 2.0**n`` exactly: two normal factors, so that ``n`` may reach +-133 (bfloat16's subnormals)."""
    half = n >> 1
    return x * exact_pow2(half) * exact_pow2(n - half)


def _spacing_exponent(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``k`` such that ``2.0**k`` is the spacing of ``dtype``'s values in the binade of ``x`` (float32)."""
    info = jnp.finfo(dtype)
    binade = ((jax.lax.bitcast_convert_type(x, jnp.int32) >> _F32_MANTISSA) & 0xFF) - _F32_BIAS
    return jnp.maximum(binade, info.minexp) - info.nmant  # below the smallest normal the spacing is fixed


def _on_grid(x: jax.Array, dtype: np.dtype, to_integer) -> jax.Array:
    """``to_integer`` applied to ``x`` in units of ``dtype``'s spacing at ``x``; inf beyond ``dtype``'s
    largest value (as a cast); zeros keep the sign of ``x``; inf and NaN pass through."""
    k = _spacing_exponent(x, dtype)
    r = _times_pow2(to_integer(_times_pow2(x, -k)), k)
    r = jnp.where(jnp.abs(r) > jnp.finfo(dtype).max, jnp.inf, jnp.abs(r))
    return jnp.where(jnp.isfinite(x), jnp.copysign(r, x), x)


def nearest(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x.astype(dtype).astype(float32)`` bit for bit (round to nearest, ties to even), that XLA cannot fold."""
    return _on_grid(x, dtype, jnp.round)


def stochastic(x: jax.Array, dtype: np.dtype, uniform: jax.Array) -> jax.Array:
    """``x`` rounded to one of its two neighbours in ``dtype``, the upper one with probability equal to the
    distance from the lower one in units of their spacing: the mean over ``uniform`` ~ U[0, 1) is ``x``.

    Exact, not just close: the distance is a float32 multiple of 2**-16 (bfloat16) or 2**-13 (float16 normals),
    and ``uniform < distance`` for a ``jax.random.uniform`` draw (a multiple of 2**-23) has that probability.
    """

    def floor_or_up(scaled: jax.Array) -> jax.Array:
        low = jnp.floor(scaled)
        return jnp.where(uniform < scaled - low, low + 1.0, low)

    return _on_grid(x, dtype, floor_or_up)
