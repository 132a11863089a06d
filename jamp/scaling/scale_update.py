"""torch's ``_amp_update_scale_`` (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp) as a lookup table.

=============================  ==================================  ===============
outcome                        new scale                           new tracker
=============================  ==================================  ===============
BACKOFF: found_inf             max(scale * backoff, min_scale,     0
                               2**-149)
HOLD: tracker + 1 != interval  scale                               tracker + 1
GROW: tracker + 1 == interval  min(scale * growth, max_scale),     0
                               or scale if the product is inf
=============================  ==================================  ===============

The products are ``float32(double(scale) * factor)`` as torch computes them (see :mod:`jamp.scaling.exact_mul`).
The one departure from torch: a backoff never reaches 0 (torch's does, 150 backoffs below 1e-45, and
then every update is NaN with found_inf False); it stops at the smallest positive float32, whose
inverse :func:`jamp_kernels.inverse` gives exactly. ``==`` is exact: a tracker already past the interval (after ``load_state_dict``) counts on and never
grows until a backoff resets it, as in torch. Comparisons and selections work on the float32 bits as
integers: XLA flushes subnormals to zero in float compares and turns compare+select into max/min
instructions, which would lose torch's subnormal scales; an integer max or min of the bits cannot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.scaling import exact_mul
from jamp.scaling.state import ScalerState
from jamp_kernels import leafwise

_ONE = exact_mul.to_words(1.0)
_SMALLEST = np.int32(1)  # the bits of the smallest positive float32, 2**-149
_EXPONENT = np.int32(0x7F800000)


def _bits(x: jax.Array) -> jax.Array:
    """float32 bits as int32: for the non-negative floats here (scales, bounds, products) they order as the floats do,
    subnormals included."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _rule(scale, tracker, interval, growth_factor, backoff_factor, min_scale, max_scale, found_inf):
    """The table above on the state's fields: ``(scale, growth_tracker)``.

    One product, ``scale`` times the factor of the outcome (1.0 on HOLD, whose result is ``scale`` itself), then
    the clamps of the outcome: one multiply in the program instead of one per factor.
    """
    select = jax.lax.select
    counted = tracker + 1
    grow = ~found_inf & (counted == interval)

    def pick(c, a, b):  # the factors are (high, low) word pairs
        return select(jax.lax.broadcast_in_dim(c, jnp.shape(a), tuple(range(jnp.ndim(c)))), a, b)

    one = jnp.broadcast_to(_ONE, jnp.shape(growth_factor))
    product = _bits(exact_mul.mul_f32_f64(scale, pick(found_inf, backoff_factor, pick(grow, growth_factor, one))))
    old, lo, hi = _bits(scale), _bits(min_scale), _bits(max_scale)
    backed = jnp.maximum(product, lo)  # integer max: exact for subnormals, which a float max would flush
    backed = jnp.maximum(backed, _SMALLEST)  # torch's rule reaches 0, whose inverse makes NaN updates
    grown = select((product & _EXPONENT) != _EXPONENT, jnp.minimum(product, hi), old)  # inf: keep the scale
    new_scale = select(found_inf, backed, select(grow, grown, old))
    new_scale = leafwise.once(jax.lax.bitcast_convert_type(new_scale, jnp.float32))  # read by several outputs
    return new_scale, select(found_inf | grow, jnp.zeros_like(counted), counted)


# torch's one kernel, one equation in the update's jaxpr (jamp._jax_compat.fused says why)
_update_scale = jc.one_equation("amp_update_scale", _rule, (jnp.float32, jnp.int32))


def next_scale(state: ScalerState, found_inf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scale, growth_tracker)`` after an update that saw ``found_inf``: :func:`_rule` as one equation,
    ``amp_update_scale``, named after torch's ``_amp_update_scale_``."""
    scale, tracker = _update_scale(
        state.scale,
        state.growth_tracker,
        state.growth_interval,
        state.growth_factor,
        state.backoff_factor,
        state.min_scale,
        state.max_scale,
        found_inf,
    )
    return scale, tracker
