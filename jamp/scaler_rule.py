"""torch's ``_amp_update_scale_`` (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp) as a lookup table.

=============================  ==================================  ===============
outcome                        new scale                           new tracker
=============================  ==================================  ===============
BACKOFF: found_inf             max(scale * backoff, min_scale)     0
HOLD: tracker + 1 != interval  scale                               tracker + 1
GROW: tracker + 1 == interval  min(scale * growth, max_scale),     0
                               or scale if the product is inf
=============================  ==================================  ===============

The products are ``float32(double(scale) * factor)`` as torch computes them (see :mod:`jamp.exact_mul`).
``==`` is exact: a tracker already past the interval (after ``load_state_dict``) counts on and never
grows until a backoff resets it, as in torch. Selecting rows moves bits only, so float32 subnormal
scales survive although XLA flushes subnormal arithmetic to zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jamp import exact_mul
from jamp.scaler_state import ScalerState

BACKOFF, HOLD, GROW = 0, 1, 2


def next_scale(state: ScalerState, found_inf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scale, growth_tracker)`` after an update that saw ``found_inf``."""
    scale, counted = state.scale, state.growth_tracker + 1
    outcome = jnp.where(found_inf, BACKOFF, jnp.where(counted == state.growth_interval, GROW, HOLD))
    backed = exact_mul.mul_f32_f64(scale, state.backoff_factor)
    backed = jnp.where(backed < state.min_scale, state.min_scale, backed)
    grown = exact_mul.mul_f32_f64(scale, state.growth_factor)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    grown = jnp.where(grown > state.max_scale, state.max_scale, grown)
    zero = jnp.zeros_like(counted)
    return jax.lax.select_n(outcome, backed, scale, grown), jax.lax.select_n(outcome, zero, counted, zero)
