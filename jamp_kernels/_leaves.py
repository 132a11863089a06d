"""Leaf rules shared by every backend: which leaves are scaled, in which type, and input validation."""

from __future__ import annotations

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


def inv_scale_scalar(inv_scale: Any) -> jax.Array:
    """``inv_scale`` as a float32 scalar (torch keeps it as a one-element float32 tensor)."""
    inv = jnp.asarray(inv_scale, jnp.float32)
    if inv.size != 1:
        raise ValueError(f"inv_scale must hold exactly one value, got shape {inv.shape}")
    return inv.reshape(())


def scale(x: jax.Array, inv: jax.Array) -> jax.Array:
    """One leaf (or block) times ``inv`` in opmath, rounded once; ``inv == 1`` returns ``x`` bit for bit.

    The select keeps subnormals when ``inv == 1`` although XLA:CPU flushes them in arithmetic, as torch's
    ``(inv_scale == 1) ? val : val * inv_scale`` does.
    """
    op = opmath(x.dtype)
    return jnp.where(inv == 1, x, (x.astype(op) * inv.astype(op)).astype(x.dtype))
