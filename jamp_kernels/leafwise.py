"""Leafwise rules shared by every backend: which leaves are scaled, in which type, how one leaf is scaled, and
input validation. Public to the scaling wing, which reads :class:`Spread` and :func:`once`."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def flatten(grads: Any) -> tuple[list[Any], Any]:
    """``jax.tree.flatten`` that rejects leaves a gradient cannot be (Python numbers, strings, complex)."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    for path, leaf in path_leaves:
        where = f"grads{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"{where} is a {type(leaf).__name__}; every gradient leaf must be a JAX or NumPy array")
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            raise TypeError(f"{where} has complex dtype {leaf.dtype}; unscaling is defined for real floating leaves")
    return [leaf for _, leaf in path_leaves], treedef


def is_scaled(leaf: Any) -> bool:
    """Floating, non-empty leaves are unscaled and checked; integer, bool and empty leaves pass through."""
    return jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size > 0


def opmath(dtype: Any) -> Any:
    """torch's opmath type: float16/bfloat16/float32 compute in float32, float64 stays float64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _is_real(x: Any) -> bool:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def inv_scale_pair(inv_scale: Any) -> jax.Array:
    """``inv_scale`` as float32 ``[factor, power_of_two]`` whose product is the inverse scale.

    A scalar means ``[inv_scale, 1]``. The pair form (see :func:`inverse`) carries inverses outside
    float32's normal range, which XLA would flush to zero the moment they were computed. A concrete
    NaN, inf or non-positive value is refused: the check looks at the inputs, so it would not see the
    NaN that such a factor makes of every gradient.
    """
    if not _is_real(inv_scale):
        raise TypeError(
            f"inv_scale must be a real number or a real array (a scalar or a [factor, power_of_two] "
            f"pair), got {inv_scale!r} of type {type(inv_scale).__name__}"
        )
    inv = jnp.asarray(inv_scale, jnp.float32)
    if inv.size == 1:
        inv = jnp.stack([inv.reshape(()), jnp.float32(1.0)])
    elif inv.shape != (2,):
        raise ValueError(f"inv_scale must be a scalar or a [factor, power_of_two] pair, got shape {inv.shape}")
    if not isinstance(inv, jax.core.Tracer) and not np.all(np.isfinite(inv) & (np.asarray(inv) > 0)):
        raise ValueError(f"inv_scale must be finite and > 0, got {inv_scale!r}")
    return inv


_SHIFT = 2.0**64
_SUBNORMAL_ONE = 2.0**85  # 2**149 / 2**64: a subnormal scale is m * 2**-149, its inverse 2**85 / m * 2**64


def inverse(scale: Any) -> jax.Array:
    """The inverse of a loss scale as an ``inv_scale`` pair: ``1/scale`` rounded to 24 bits, for every
    positive float32 scale (torch's ``float32(1/float64(scale))`` wherever that is a normal float32).

    Above 2**126 torch's float32 reciprocal is subnormal, and XLA flushes subnormals to zero, which would
    zero every gradient (a scale that only grows reaches that range after ~110 growths). There the pair is
    ``[float32(2**64 / scale), 2**-64]``: the same value at full float32 precision.

    Below 2**-126 the scale itself is subnormal, and XLA flushes it to zero before dividing (1/scale
    became inf, and 0 * inf NaN gradients that the input check never saw). There the pair is computed
    from the scale's bits, ``m * 2**-149`` with an integer ``m``: ``[float32(2**85 / m), 2**64]``, finite
    even where torch's ``1/scale`` overflows to inf (below about 2**-128).
    """
    scale = jnp.asarray(scale, jnp.float32)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    tiny = (bits & 0x7F800000) == 0  # exponent field 0: zero or subnormal
    big = scale > 2.0**126
    m = (bits & 0x7FFFFF).astype(jnp.float32)  # exact: m < 2**23

    def pick(big_value, tiny_value, normal_value):
        big_value, tiny_value, normal_value = (
            jnp.full(scale.shape, np.float32(v)) for v in (big_value, tiny_value, normal_value)
        )
        return jax.lax.select(big, big_value, jax.lax.select(tiny, tiny_value, normal_value))

    numerator = pick(_SHIFT, _SUBNORMAL_ONE, 1.0)
    return jnp.stack([numerator / jax.lax.select(tiny, m, scale), pick(1 / _SHIFT, _SHIFT, 1.0)])


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned integer type as wide as ``dtype``: how a leaf's values travel when they must not change."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def to_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, dtype)


class Spread:
    """Scalars broadcast once per shape and dtype, for one trace: a tree of many leaves of a few shapes then
    holds one broadcast of each scalar per shape (GPT-2's 148 leaves have 11 shapes), not one per leaf."""

    def __init__(self) -> None:
        self._made: dict = {}

    def __call__(self, name: str, scalar: Any, like: jax.Array, dtype: Any = None) -> jax.Array:
        """``scalar`` (which ``name`` stands for in this trace) as an array of ``like``'s shape, in ``dtype``
        (``like``'s by default)."""
        dtype = np.dtype(like.dtype if dtype is None else dtype)
        key = (name, like.shape, dtype, jax.typeof(like).sharding)  # sharded like ``like`` under explicit axes
        if key not in self._made:
            self._made[key] = jax.lax.full_like(like, jnp.asarray(scalar, dtype), dtype)
        return self._made[key]


def once(x: jax.Array) -> jax.Array:
    """``x``, bit for bit, computed once: its bits divided by 1, a 1 that XLA does not see.

    Many loops read the scalars of the scale (its inverse, the new scale). XLA fuses the cheap scalar steps
    that compute them into every loop that reads them, hundreds of copies in a large tree, and XLA:CPU
    removes ``lax.optimization_barrier`` before it fuses. An integer division by a value that XLA cannot
    fold counts as expensive, so XLA computes it, and what feeds it, once, and the loops read the result.
    """
    bits = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))
    out = jax.lax.div(bits, ((bits | 1) != 0).astype(bits.dtype))
    return out.astype(jnp.bool_) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(out, x.dtype)


def keeps(factor: jax.Array, power_of_two: jax.Array) -> jax.Array:
    """Whether the inverse ``factor * power_of_two`` is exactly 1, where :func:`scale` returns its input."""
    return (factor == 1) & (power_of_two == 1)


def scale(x: jax.Array, factor: jax.Array, power_of_two: jax.Array, keep: jax.Array | None = None) -> jax.Array:
    """One leaf (or block) times ``factor * power_of_two`` in opmath, rounded once (the power of two is
    exact); an inverse of exactly 1 returns ``x`` bit for bit, subnormals included, as torch's
    ``(inv_scale == 1) ? val : val * inv_scale`` does. ``factor`` and ``power_of_two`` are scalars or arrays
    of ``x``'s shape (:class:`Spread`); ``keep``, a scalar, is :func:`keeps` of the pair, computed here when
    not given (a caller that scales many leaves computes it once).

    The select picks between ``x`` and the product unchanged: XLA:CPU flushes subnormals in arithmetic, not
    in a select. For 16-bit floats it picks between their bits: XLA:CPU widens a bfloat16 select to float32
    and narrows the result back, which flushes subnormals wherever the float32-to-bfloat16 convert is the
    AVX512-BF16 instruction ``vcvtneps2bf16`` (it always flushes). Bitcasts cost nothing. ``x * factor``
    comes first: for the pair of a subnormal scale it is ``x / scale * 2**-64``, a normal float whenever
    ``x`` is (``x / scale > 1``).
    """
    op = opmath(x.dtype)
    scaled = (x.astype(op) * factor.astype(op) * power_of_two.astype(op)).astype(x.dtype)
    keep = keeps(factor, power_of_two) if keep is None else keep
    if np.dtype(x.dtype).itemsize >= 4:
        return jax.lax.select(jnp.broadcast_to(keep, x.shape) if jnp.ndim(keep) else keep, x, scaled)
    return from_bits(jnp.where(keep, to_bits(x), to_bits(scaled)), x.dtype)
