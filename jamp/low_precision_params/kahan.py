"""``jamp.kahan_summation``: Kahan-compensated updates of float16/bfloat16 parameters, without float32 masters.

Round-to-nearest drops every update smaller than half the spacing of the parameter's values (2**-8 at 1.0
in bfloat16), so small learning rates stall training. Kahan summation keeps what each step's rounding lost
in a buffer of the parameters' dtype and adds it back on the next step: parameter plus buffer carry about
twice the format's precision (16 significant bits for bfloat16) at half the memory of a float32 master.
A float32 buffer would cost 6 bytes per parameter for what a float32 master holds in 4; so the buffer
always has the parameters' dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp.low_precision_params import grid, leaves

_WHO = "jamp.kahan_summation"


class KahanSummationState(NamedTuple):
    """State of :func:`jamp.kahan_summation`: the compensation buffer and the wrapped optimizer's state.

    Attributes:
        compensation: a pytree like the parameters: for each float16/bfloat16 parameter, in its dtype, what
            its value lacks (what the roundings lost, added back on the next step); None for the others.
        inner_state: the state of the optimizer ``kahan_summation`` wraps.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> tx = jamp.kahan_summation(optax.sgd(1e-3))
        >>> tx.init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.zeros(2)}).compensation
        {'b': None, 'w': Array([0, 0], dtype=bfloat16)}
    """

    compensation: Any  # per float16/bfloat16 parameter, in its dtype: what its value lacks; None elsewhere
    inner_state: optax.OptState


def _compensated(
    old: jax.Array, update: jax.Array, compensation: jax.Array, dtype: np.dtype
) -> tuple[jax.Array, jax.Array]:
    """One step of Kahan summation: the sum ``old + update + compensation`` is formed in float32 (as a GPU's
    bfloat16 arithmetic does), rounded to ``dtype`` for the parameter, and what that rounding lost (exact in
    float32) is rounded to ``dtype`` for the buffer. A zero update leaves both as they are (a skipped or
    accumulating step, e.g. of ``optax.MultiSteps`` or ``jamp.scaler`` inside); a parameter that is not
    finite carries no compensation."""
    carried = compensation.astype(jnp.float32)
    total = old + (update + carried)
    new = grid.nearest(total, dtype)  # not astype: XLA may fold a narrowing-widening pair (see grid)
    lost = jnp.where(jnp.isfinite(new), total - new, 0.0)
    moved = update != 0
    return jnp.where(moved, new, old), jnp.where(moved, lost, carried).astype(compensation.dtype)


def kahan_summation(
    inner: optax.GradientTransformation, *, state_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that float16/bfloat16 parameters are updated with Kahan-compensated summation.

    ``update`` returns, for each float16/bfloat16 parameter, the float32 update ``new - old`` that makes
    ``optax.apply_updates(params, updates)`` land it exactly on the compensated value (apply_updates adds in
    float32 and rounds once). The compensation buffer has the parameters' dtype. float32/float64 parameters
    get ``inner``'s updates unchanged. A zero update (a skipped step) leaves parameter and buffer as they are.

    ``state_dtype``: None (default) lets ``inner`` see the parameters and gradients in their own dtype, so
    its state is what it makes of them (``optax.adam`` keeps bfloat16 moments for bfloat16 parameters);
    ``jnp.float32`` hands it float32 copies, so its state is float32 (4 more bytes per parameter for Adam).
    Use ``jnp.float32`` with Adam on float16 parameters: its ``eps=1e-8`` is 0 in float16, and a second
    moment that underflows then makes the update 0 / 0.

    Args:
        inner: the optax transformation (the optimizer) whose updates are applied with compensation.
        state_dtype: None, or ``jnp.float32`` (or "float32") to hand ``inner`` float32 copies of the
            float16/bfloat16 parameters and gradients.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`jamp.KahanSummationState`;
        ``update`` needs ``params``.

    Raises:
        TypeError: when ``inner`` is not an optax transformation, or a parameter is not a float16, bfloat16,
            float32 or float64 array.
        ValueError: for a ``state_dtype`` other than None and float32, or an ``update`` without ``params``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> lr = 1e-3  # under half bfloat16's spacing at 1.0
        >>> tx = jamp.kahan_summation(optax.sgd(lr))
        >>> opt_state = tx.init(params)
        >>> step = jax.jit(tx.update)
        >>> for _ in range(3):
        ...     updates, opt_state = step(grads, opt_state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"]  # 0.997 rounded to bfloat16; plain optax.sgd(1e-3) leaves 1
        Array([0.996094, 0.996094], dtype=bfloat16)
    """
    inner_tx = leaves.checked_inner(_WHO, inner)
    state_dtype = leaves.checked_state_dtype(_WHO, state_dtype)

    def init(params: optax.Params) -> KahanSummationState:
        inner_state = leaves.inner_init(_WHO, inner_tx, params, state_dtype)
        return KahanSummationState(
            compensation=jax.tree.map(lambda p: jnp.zeros_like(p) if leaves.is_low(p) else None, params),
            inner_state=inner_state,
        )

    def update(
        grads: optax.Updates, state: KahanSummationState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, KahanSummationState]:
        updates, inner_state = leaves.inner_update(_WHO, inner_tx, grads, state.inner_state, params, state_dtype, extra)
        updates, compensation = leaves.map_low(_compensated, params, updates, state.compensation)
        return updates, KahanSummationState(compensation=compensation, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
