"""XLA implementation: plain jnp code that XLA fuses into its consumers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _opmath(dtype):
    """torch's opmath: half types compute in float32, float64 stays float64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def unscale(grads, inv_scale):
    """Multiply every floating leaf by ``inv_scale`` in its opmath type and round once to its dtype."""
    inv = jnp.asarray(inv_scale, jnp.float32)

    def leaf(g):
        if not _is_float(g):
            return g
        return (g.astype(_opmath(g.dtype)) * inv.astype(_opmath(g.dtype))).astype(g.dtype)

    return jax.tree.map(leaf, grads)


def has_nonfinite(grads) -> jax.Array:
    """Scalar bool: any inf/NaN in any floating leaf. ``max(|g|)`` propagates NaN and avoids a bool temporary."""
    flags = [jnp.logical_not(jnp.isfinite(jnp.max(jnp.abs(g)))) for g in jax.tree.leaves(grads) if _is_float(g) and g.size]
    if not flags:
        return jnp.zeros((), jnp.bool_)
    return jnp.any(jnp.stack(flags))


def unscale_and_check(grads, inv_scale, *, backend: str = "auto"):
    """Return ``(unscaled_grads, found_inf)``; ``found_inf`` looks at the scaled (input) values."""
    return unscale(grads, inv_scale), has_nonfinite(grads)
