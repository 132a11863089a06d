"""``jamp.stochastic_rounding``: float16/bfloat16 parameters updated with stochastic rounding, no buffer.

Each new value is rounded up or down at random, the upper neighbour with probability equal to the distance
from the lower one, so the expected parameter is the exact float32 sum: updates smaller than the spacing
of the format's values are kept in expectation. It needs no buffer, only a PRNG key in the state.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jamp._arguments import shown
from jamp.low_precision_params import grid, leaves

_WHO = "jamp.stochastic_rounding"


class StochasticRoundingState(NamedTuple):
    """State of :func:`jamp.stochastic_rounding`: the PRNG key and the wrapped optimizer's state.

    The key is kept as its raw uint32 data (``jax.random.key_data``) so that checkpointing, ``jnp.where``
    and ``jamp.scaler``'s skip treat it like any other array.

    Attributes:
        key: the PRNG key's uint32 data; split on every update.
        inner_state: the state of the optimizer ``stochastic_rounding`` wraps.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> tx = jamp.stochastic_rounding(optax.sgd(1e-3), seed=0)
        >>> opt_state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> key = opt_state.key  # jax.random.key_data of the default PRNG
        >>> key.dtype, key.shape
        (dtype('uint32'), (2,))
    """

    key: jax.Array  # uint32 key data; split on every update
    inner_state: optax.OptState


def _checked_seed(seed: Any) -> int:
    """``seed`` as an int in [0, 2**32): JAX without x64 keeps only the low 32 bits of a seed."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{_WHO}: seed must be an int, got {shown(seed)} of type {type(seed).__name__} (under "
            "optax.inject_hyperparams, name it in static_args=('seed',))"
        )
    if not 0 <= int(seed) < 2**32:
        raise ValueError(
            f"{_WHO}: seed must be an int in [0, 2**32), got {shown(seed)} (JAX keeps 32 bits of a "
            "seed, so larger seeds would repeat smaller ones)"
        )
    return int(seed)


def _rounded(old: jax.Array, update: jax.Array, key: jax.Array, dtype: np.dtype) -> tuple[jax.Array, None]:
    """``old + update`` (float32) rounded stochastically to ``dtype``; a zero update leaves ``old``.

    Under jit the draws are laid out like the parameter (each device draws its shard). Inside shard_map a
    shard that differs per device (its manual axes vary) folds in its position, so shards draw different
    numbers, while replicas of one parameter draw the same and stay identical.
    """
    for name in sorted(jax.typeof(old).manual_axis_type.varying):
        key = jax.random.fold_in(key, jax.lax.axis_index(name))
    uniform = jax.random.uniform(key, old.shape, out_sharding=jax.typeof(old).sharding)
    return grid.stochastic(old + update, dtype, uniform), None


def _leaf_keys(step_key: jax.Array, params: Any) -> Any:
    """One key per low-precision leaf (``fold_in`` of its position in ``params``), None elsewhere."""
    flat, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(
        tree, [jax.random.fold_in(step_key, i) if leaves.is_low(p) else None for i, p in enumerate(flat)]
    )


def stochastic_rounding(
    inner: optax.GradientTransformation, seed: int = 0, *, state_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that float16/bfloat16 parameters are updated with stochastic rounding.

    ``update`` returns, for each float16/bfloat16 parameter, the float32 update ``new - old`` that makes
    ``optax.apply_updates(params, updates)`` land it exactly on ``old + inner_update`` (summed in float32)
    rounded stochastically: unbiased, the same for the same ``seed``, independent across parameters and
    steps. The key lives in the state and is split on every update. float32/float64 parameters get
    ``inner``'s updates unchanged; inf and NaN pass through.

    ``state_dtype``: as in :func:`jamp.kahan_summation` (None: ``inner`` sees the parameters' own dtype;
    ``jnp.float32`` for Adam on float16 parameters).

    Args:
        inner: the optax transformation (the optimizer) whose updates are applied with stochastic rounding.
        seed: the PRNG seed, an int in [0, 2**32).
        state_dtype: None, or ``jnp.float32`` (or "float32") to hand ``inner`` float32 copies of the
            float16/bfloat16 parameters and gradients.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`jamp.StochasticRoundingState`;
        ``update`` needs ``params``.

    Raises:
        TypeError: when ``inner`` is not an optax transformation, ``seed`` is not an int, or a parameter is
            not a float16, bfloat16, float32 or float64 array.
        ValueError: for a ``seed`` outside [0, 2**32), a ``state_dtype`` other than None and float32, or an
            ``update`` without ``params``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
        >>> tx = jamp.stochastic_rounding(optax.sgd(1e-3), seed=0)
        >>> opt_state = tx.init(params)
        >>> grads = {"w": jnp.ones(1000, jnp.bfloat16)}
        >>> updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
        >>> w = optax.apply_updates(params, updates)["w"]
        >>> sorted(set(w.tolist()))  # at random: 0.999 down to a bfloat16 or up to 1
        [0.99609375, 1.0]
        >>> round(sum(w.tolist()) / 1000, 3)  # 0.999 in expectation
        0.999
    """
    inner_tx = leaves.checked_inner(_WHO, inner)
    seed = _checked_seed(seed)
    state_dtype = leaves.checked_state_dtype(_WHO, state_dtype)

    def init(params: optax.Params) -> StochasticRoundingState:
        inner_state = leaves.inner_init(_WHO, inner_tx, params, state_dtype)
        return StochasticRoundingState(key=jax.random.key_data(jax.random.key(seed)), inner_state=inner_state)

    def update(
        grads: optax.Updates, state: StochasticRoundingState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, StochasticRoundingState]:
        updates, inner_state = leaves.inner_update(_WHO, inner_tx, grads, state.inner_state, params, state_dtype, extra)
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        updates, _ = leaves.map_low(_rounded, params, updates, _leaf_keys(step_key, params))
        return updates, StochasticRoundingState(key=jax.random.key_data(next_key), inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
