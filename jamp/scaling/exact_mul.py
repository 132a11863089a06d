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


def _mul_limbs(a: list, b: list) -> list:
    """Schoolbook product of little-endian 16-bit limbs held in uint32; returns 16-bit limbs."""
    cols: list = [None] * (len(a) + len(b))  # column sums: at most 2 * len(a) terms below 2**16 each

    def add(k, v):
        cols[k] = v if cols[k] is None else cols[k] + v

    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            p = ai * bj  # < 2**32: exact in uint32
            add(i + j, p & 0xFFFF)
            add(i + j + 1, p >> 16)
    limbs, carry = [], None
    for c in cols:
        c = c if carry is None else c + carry
        limbs.append(c & 0xFFFF)
        carry = c >> 16
    return [*limbs, carry]


def _field(words: dict, limbs: list, lo: int, n: int, back: jax.Array) -> jax.Array:
    """Bits ``lo - back .. lo - back + n - 1`` (n <= 16, ``lo % 16 >= 1``) of a number given as 16-bit limbs;
    ``words`` keeps the 32-bit words already formed, so that each is formed once."""
    k, off = divmod(lo, 16)
    if k not in words:
        words[k] = limbs[k] | (limbs[k + 1] << 16)  # 32 bits starting at limb k
    return (words[k] >> (off - back)) & ((1 << n) - 1)


def _round_up(guard: jax.Array, sticky: jax.Array, kept: jax.Array) -> jax.Array:
    """Round-to-nearest-even increment: 1 when the dropped part is above half, or exactly half and odd."""
    return (guard & (sticky.astype(_U32) | (kept & 1))).astype(_U32)


def mul_f32_f64(x: jax.Array, words: jax.Array) -> jax.Array:
    """``float32(float64(x) * factor)`` with ``factor`` given by :func:`to_words`; any float32 ``x``.

    The factor must be a positive finite double; subnormal factors give 0 (any float32 times one
    is far below the smallest float32 subnormal).
    """
    x = jnp.asarray(x, jnp.float32)
    words = jnp.asarray(words, _U32)
    xb = jax.lax.bitcast_convert_type(x, _U32)
    hi, lo = words[..., 0], words[..., 1]

    # x = ms * 2**(x_exp - 150) with ms normalized into [2**23, 2**24); subnormals shifted up.
    x_field = ((xb >> 23) & 0xFF).astype(_I32)
    x_man = xb & 0x7FFFFF
    lz = jax.lax.clz(x_man).astype(_I32) - 8
    x_sub = x_field == 0
    ms = jnp.where(x_sub, x_man << jnp.clip(lz, 0, 23).astype(_U32), x_man | 0x800000)
    x_exp = jnp.where(x_sub, 1 - lz, x_field)

    # factor = mF * 2**(f_exp - 1075), mF in [2**52, 2**53).
    f_exp = ((hi >> 20) & 0x7FF).astype(_I32)
    f_hi = (hi & 0xFFFFF) | 0x100000

    p = _mul_limbs([ms & 0xFFFF, ms >> 16], [lo & 0xFFFF, lo >> 16, f_hi & 0xFFFF, f_hi >> 16])
    # The product lies in [2**75, 2**77); its fields are read one bit lower (``back``) when bit 76 is 0.
    top = (p[4] >> 12) & 1
    back, words = 1 - top, {}

    # Bits 76..53 -> t24, 52..24 -> r29 (together the 53-bit double significand), 23 guard, rest sticky.
    t24 = _field(words, p, 53, 16, back) | (_field(words, p, 69, 8, back) << 16)
    r29 = _field(words, p, 24, 16, back) | (_field(words, p, 40, 13, back) << 16)
    guard = _field(words, p, 23, 1, back)
    sticky = (p[0] | (p[1] & (0x7F >> back))) != 0
    r29 = r29 + _round_up(guard, sticky, r29)  # round to 53 bits
    t24 = t24 + (r29 >> 29)
    r29 = r29 & ((1 << 29) - 1)

    # Round to float32: keep 24 bits (fewer in the subnormal range, `sh` more dropped).
    biased = x_exp + f_exp + top.astype(_I32) - 1023
    sh = jnp.clip(1 - biased, 0, 26).astype(_U32)
    u = (t24 << 1) | (r29 >> 28)  # t24 followed by the guard bit of the normal case
    kept = u >> (sh + 1)
    g = (u >> sh) & 1
    s = ((u & ((1 << sh) - 1)) | (r29 & ((1 << 28) - 1))) != 0
    kept = kept + _round_up(g, s, kept)
    exp_field = (jnp.clip(biased, 1, 255) - 1).astype(_U32)
    out = jnp.minimum((exp_field << 23) + kept, 0x7F800000)  # the adder carries into the exponent; cap at inf

    is_zero = (x_sub & (x_man == 0)) | (f_exp == 0)  # zero times anything, or a subnormal factor
    out = jnp.where(is_zero, 0, out)
    inf_or_nan = xb & 0x7FFFFFFF
    out = jnp.where(x_field == 0xFF, jnp.where(x_man == 0, inf_or_nan, inf_or_nan | 0x400000), out)  # NaN made quiet
    out = out | (xb & _SIGN)
    return jax.lax.bitcast_convert_type(out, jnp.float32)
