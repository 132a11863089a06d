"""``float32(double(x) * factor)`` bit for bit, without float64.

torch's ``_amp_update_scale_`` multiplies the float32 scale by a Python-float (double) factor in double
precision and rounds the product to float32 once: ``3.0 * 1.1`` gives ``3.299999952316284`` where a
float32 multiply gives ``3.3000001907348633``. JAX has no float64 unless ``jax_enable_x64`` is set (and
TPUs have none at all), so the factor is kept as the two 32-bit words of its IEEE-754 double and the
product is formed with integer arithmetic: the exact 77-bit product of the two significands, rounded
to nearest-even at 53 bits (the double multiply) and then at float32 precision (the conversion), float32
subnormals included. Integer operations are exact on every backend and immune to FMA contraction and
to the flush-to-zero of float32 subnormals that XLA applies to float arithmetic.

The code is elementwise, so it works on scalars (the scale) and on arrays (tests compare it with
numpy on many random pairs).
"""

from __future__ import annotations

import itertools
import struct

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32
_I32 = jnp.int32
_SIGN = np.uint32(0x80000000)  # above int32: a Python int literal would not fit JAX's weak int type


def to_words(x: float) -> np.ndarray:
    """The IEEE-754 double of ``x`` as ``uint32[2]`` (high word, low word)."""
    return np.array(struct.unpack(">II", struct.pack(">d", float(x))), np.uint32)


def from_words(words) -> float:
    """Inverse of :func:`to_words`: the exact Python float."""
    hi, lo = (int(w) for w in np.asarray(words, np.uint32))
    return struct.unpack(">d", struct.pack(">II", hi, lo))[0]


# The 16-bit half ``h`` of the product of x's limb ``i`` and the factor's limb ``j`` lands in column ``h + i + j``.
_COLUMN = np.zeros((2, 2, 4, 6), np.uint32)
for _h, _i, _j in itertools.product(range(2), range(2), range(4)):
    _COLUMN[_h, _i, _j, _h + _i + _j] = 1


def _limbs(words: jax.Array) -> jax.Array:
    """``(..., n)`` uint32 words as ``(..., 2n)`` little-endian 16-bit limbs."""
    return jnp.stack([words & 0xFFFF, words >> 16], -1).reshape(*words.shape[:-1], -1)


def _product_limbs(ms: jax.Array, f_lo: jax.Array, f_hi: jax.Array) -> list:
    """``ms * (f_hi * 2**32 + f_lo)`` (24 by 53 bits) as six little-endian 16-bit limbs: the schoolbook
    product of 16-bit limbs, every partial product exact in uint32, then one carry pass over the columns."""
    a = _limbs(ms[..., None])
    b = _limbs(jnp.stack([f_lo, f_hi], -1))
    p = a[..., :, None] * b[..., None, :]  # < 2**32 each
    columns = jnp.sum(jnp.stack([p & 0xFFFF, p >> 16], -3)[..., None] * _COLUMN, axis=(-4, -3, -2), dtype=_U32)

    def carry_into(carry, column):
        total = column + carry
        return total >> 16, total & 0xFFFF

    _, limbs = jax.lax.scan(carry_into, jnp.zeros_like(ms), jnp.moveaxis(columns, -1, 0), unroll=True)
    return list(limbs)


def _round_up(guard: jax.Array, sticky: jax.Array, kept: jax.Array) -> jax.Array:
    """Round-to-nearest-even increment: 1 when the dropped part is above half, or exactly half and odd."""
    return guard & (sticky.astype(_U32) | (kept & 1))


def mul_f32_f64(x: jax.Array, words: jax.Array) -> jax.Array:
    """``float32(float64(x) * factor)`` with ``factor`` given by :func:`to_words`; any float32 ``x``.

    The factor must be a positive finite double; subnormal factors give 0 (any float32 times one
    is far below the smallest float32 subnormal).
    """
    xb = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), _U32)
    words = jnp.asarray(words, _U32)
    hi, lo = words[..., 0], words[..., 1]
    select = jax.lax.select

    # x = ms * 2**(x_exp - 150) with ms normalized into [2**23, 2**24); subnormals shifted up.
    x_field = (xb >> 23) & 0xFF
    x_man = xb & 0x7FFFFF
    lz = jax.lax.clz(x_man) - 8  # >= 1; 24 for a zero significand, which stays zero
    x_sub = x_field == 0
    ms = select(x_sub, x_man << lz, x_man | 0x800000)
    x_exp = select(x_sub, 1 - lz, x_field).astype(_I32)

    # factor = mF * 2**(f_exp - 1075), mF = f_hi * 2**32 + lo in [2**52, 2**53).
    f_exp = ((hi >> 20) & 0x7FF).astype(_I32)
    l0, l1, l2, l3, l4, _ = _product_limbs(ms, lo, (hi & 0xFFFFF) | 0x100000)
    # The product lies in [2**75, 2**77); its fields are read one bit lower (``back``) when bit 76 is 0.
    top = (l4 >> 12) & 1
    back = 1 - top

    # Bits 76..53 -> t24, 52..24 -> r29 (together the 53-bit double significand), 23 guard, rest sticky.
    t24 = ((l3 | (l4 << 16)) >> (5 - back)) & 0xFFFFFF
    r29 = (((l1 | (l2 << 16)) >> (8 - back)) | (l3 << (24 + back))) & 0x1FFFFFFF
    guard = (l1 >> (7 - back)) & 1
    sticky = (l0 | (l1 & (0x7F >> back))) != 0
    r29 = r29 + _round_up(guard, sticky, r29)  # round to 53 bits
    t24 = t24 + (r29 >> 29)
    r29 = r29 & 0x1FFFFFFF

    # Round to float32: keep 24 bits (fewer in the subnormal range, `sh` more dropped).
    biased = x_exp + f_exp + top.astype(_I32) - 1023
    sh = jax.lax.clamp(np.int32(0), 1 - biased, np.int32(26)).astype(_U32)
    u = (t24 << 1) | (r29 >> 28)  # t24 followed by the guard bit of the normal case
    kept = u >> (sh + 1)
    sticky = ((u & ((1 << sh) - 1)) | (r29 & 0xFFFFFFF)) != 0
    kept = kept + _round_up((u >> sh) & 1, sticky, kept)
    exp_field = (jax.lax.clamp(np.int32(1), biased, np.int32(255)) - 1).astype(_U32)
    out = jnp.minimum((exp_field << 23) + kept, _u32(0x7F800000))  # the adder carries into the exponent; cap at inf

    is_zero = (x_sub & (x_man == 0)) | (f_exp == 0)  # zero times anything, or a subnormal factor
    inf_or_nan = (xb & 0x7FFFFFFF) | select(x_man == 0, _u32(0, x_man), _u32(0x400000, x_man))  # NaN made quiet
    out = select(x_field == 0xFF, inf_or_nan, select(is_zero, _u32(0, out), out))
    return jax.lax.bitcast_convert_type(out | (xb & _SIGN), jnp.float32)


def _u32(value: int, like: jax.Array | None = None) -> jax.Array:
    """A uint32 constant, broadcast to ``like``'s shape when given (``lax.select`` broadcasts nothing)."""
    c = np.uint32(value)
    return c if like is None else jnp.full(jnp.shape(like), c)
