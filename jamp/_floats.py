"""Exact float32 facts both wings need (fp8 scaling in casting, the low-precision grid in the optimizer wing)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def exact_pow2(exponent: Any) -> Any:
    """``2.0**exponent`` in float32, exactly, for integer exponents in [-126, 127]: built from its exponent
    bits (``jnp.exp2`` is a transcendental whose result a backend may round)."""
    return jax.lax.bitcast_convert_type((exponent.astype(jnp.int32) + 127) << 23, jnp.float32)
