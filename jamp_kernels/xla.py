"""XLA implementation: plain jnp code that XLA fuses into its consumers (the fallback off CUDA)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jamp_kernels import _leaves


def unscale(grads: Any, inv_scale: Any) -> Any:
    """Multiply every floating leaf by ``inv_scale`` (a scalar or an :func:`inverse` pair) in its opmath
    type and round once to its dtype."""
    leaves, treedef = _leaves.flatten(grads)
    inv = _leaves.inv_scale_pair(inv_scale)
    return jax.tree.unflatten(treedef, [_leaves.scale(g, inv[0], inv[1]) if _leaves.is_scaled(g) else g
                                        for g in leaves])


def has_nonfinite(grads: Any) -> jax.Array:
    """Scalar bool: any inf/NaN in any floating leaf.

    ``isnan(sum(g - g))``: ``g - g`` is 0 for finite values and NaN for inf/NaN, and a sum never drops a
    NaN. It writes no bool temporary (``any(~isfinite(g))`` does, and is ~25% slower on XLA:CPU), and
    unlike ``~isfinite(max|g|)`` it is exact: XLA:CPU's vectorised float32 ``max`` reduction loses NaNs
    (e.g. a NaN at index 0 of 4097 elements).
    """
    leaves, _ = _leaves.flatten(grads)
    flags = [jnp.isnan(jnp.sum(g - g)) for g in leaves if _leaves.is_scaled(g)]
    if not flags:
        return jnp.zeros((), jnp.bool_)
    return jnp.any(jnp.stack(flags))
