"""Which parameters a low-precision wrapper treats, how the wrapped optimizer sees them, and the update
that lands ``optax.apply_updates`` exactly on a chosen value.

``optax.apply_updates`` computes ``(p + u).astype(p.dtype)``; for a bfloat16 ``p`` and a float32 ``u`` jnp
promotes the sum to float32, so it is one float32 add rounded once to bfloat16. With ``u = new - old`` in
float32 that add gives ``new`` itself, which the cast keeps, whenever ``new - old`` is exact in float32:
for every step that does not shrink a parameter by more than 2**15 (bfloat16) or 2**12 (float16) without
reaching zero (tests/low_precision_params/test_low_precision_params.py draws such steps from every binade). A larger shrink
lands within one float32 ulp of the old value, as a float32 master's update would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp._arguments import checked_transformation, shown

# Parameter dtype -> what a low-precision wrapper does with it. float32 and float64 parameters need no
# help (the inner optimizer's update is returned unchanged); float8 and non-floating leaves are refused.
LOW, WIDE = "low precision: compensated or rounded", "wide: the inner update unchanged"
ROLE_OF_DTYPE = {
    np.dtype(jnp.float16): LOW,
    np.dtype(jnp.bfloat16): LOW,
    np.dtype(jnp.float32): WIDE,
    np.dtype(jnp.float64): WIDE,
}


def is_low(x: Any) -> bool:
    """``x`` is a parameter whose updates the wrapper treats (float16 or bfloat16)."""
    return ROLE_OF_DTYPE.get(np.dtype(x.dtype)) == LOW


def check_params(who: str, params: Any) -> None:
    """A TypeError naming the first leaf of ``params`` whose dtype :data:`ROLE_OF_DTYPE` lacks."""
    if params is None:
        raise ValueError(
            f"{who}: tx.update needs params (tx.update(grads, opt_state, params)): the new value of "
            "each low-precision parameter is computed from the old one"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or np.dtype(dtype) not in ROLE_OF_DTYPE:
            raise TypeError(
                f"{who}: params{jax.tree_util.keystr(path)} is {shown(leaf) if dtype is None else dtype}; "
                "params must be float16 or bfloat16 arrays (their updates are treated) or float32/float64 arrays "
                "(the inner optimizer's update is returned unchanged)"
            )


def checked_state_dtype(who: str, state_dtype: Any) -> np.dtype | None:
    """``state_dtype`` as a numpy dtype (None or float32); a ValueError naming the argument otherwise."""
    if state_dtype is None:
        return None
    try:
        dtype = np.dtype(state_dtype)
    except TypeError:
        dtype = None
    if dtype != np.dtype(jnp.float32):
        raise ValueError(
            f"{who}: state_dtype must be None (the inner optimizer sees the parameters' own dtype) or "
            f"float32, got {shown(state_dtype)}"
        )
    return dtype


def checked_inner(who: str, inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner`` with extra-args support; a TypeError naming ``who``'s argument inner if it is no transformation."""
    return optax.with_extra_args_support(checked_transformation(f"{who}'s argument inner", inner))


def _view(tree: Any, params: Any, state_dtype: np.dtype | None) -> Any:
    """``tree`` (params or grads) as the inner optimizer sees it: low-precision leaves cast to ``state_dtype``."""
    if state_dtype is None:
        return tree
    return jax.tree.map(lambda x, p: x.astype(state_dtype) if is_low(p) else x, tree, params)


def inner_init(
    who: str, inner: optax.GradientTransformationExtraArgs, params: Any, state_dtype: np.dtype | None
) -> optax.OptState:
    """``inner``'s state for ``params`` (seen in ``state_dtype`` where they are low precision)."""
    check_params(who, params)
    return inner.init(_view(params, params, state_dtype))


def inner_update(
    who: str,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    state_dtype: np.dtype | None,
    extra: dict,
) -> tuple[Any, Any]:
    """``inner.update`` on grads and params seen in ``state_dtype`` where the parameters are low precision."""
    check_params(who, params)
    return inner.update(_view(grads, params, state_dtype), inner_state, _view(params, params, state_dtype), **extra)


def landing_update(new: jax.Array, old: jax.Array) -> jax.Array:
    """The float32 update ``u`` for which ``(old + u).astype(old.dtype)`` is ``new`` (both float32 values of
    ``old.dtype``): ``new - old``, or a zero of ``new``'s sign where they are equal (``inf - inf`` is NaN,
    and ``-0.0 + 0.0`` would be ``+0.0``)."""
    return jnp.where(new == old, jnp.copysign(jnp.zeros_like(new), new), new - old)


def map_low(leaf_step: Callable, params: Any, updates: Any, per_leaf: Any) -> tuple[Any, Any]:
    """``leaf_step(old, update, extra, dtype) -> (new, new_extra)`` on each low-precision leaf (``old``,
    ``update`` and ``new`` in float32, ``dtype`` the parameter's, ``extra`` the leaf's entry in ``per_leaf``).

    Returns the landing updates (wide leaves: ``updates`` unchanged) and the tree of ``new_extra`` (None at
    wide leaves)."""

    def one(p, u, extra):
        if not is_low(p):
            return u, None
        old = p.astype(jnp.float32)
        new, new_extra = leaf_step(old, u.astype(jnp.float32), extra, p.dtype)
        return landing_update(new, old), new_extra

    pairs = jax.tree.map(one, params, updates, per_leaf)
    return tuple(jax.tree.map(lambda _, pair, i=i: pair[i], params, pairs) for i in (0, 1))
