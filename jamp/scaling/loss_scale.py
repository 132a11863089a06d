"""Pure functions on an optimizer state that holds a :func:`jamp.scaler` state anywhere inside it.

They replace torch GradScaler's methods: the scale lives in the opt_state, so a training step reads it
from there (``jamp.scale(loss, opt_state)``) and gets a new opt_state back instead of mutating a scaler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jamp_kernels
from jamp.scaling import skip_report
from jamp.scaling import state as scaler_state
from jamp.scaling.state import DisabledScalerState


def _scale_leaf(x: Any, scale: jax.Array) -> jax.Array:
    """torch's ``outputs * _scale`` with ``_scale`` a 0-dim float32 tensor.

    A 0-dim loss promotes (bf16/f16 -> f32, so neither the scale nor the scaled loss ever lives in half
    precision: mpx's bug); a floating array with dimensions keeps its dtype, computed in float32 and
    rounded once, as torch does.
    """
    x = jnp.asarray(x)
    out = x * scale
    return out.astype(x.dtype) if x.ndim and jnp.issubdtype(x.dtype, jnp.floating) else out


def _scaled(loss_or_tree: Any, opt_state: Any) -> Any:
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return loss_or_tree
    return jax.tree.map(lambda x: _scale_leaf(x, st.scale), loss_or_tree)


def scale(loss_or_tree: Any, opt_state: Any) -> Any:
    """The loss (or every leaf of a pytree of outputs) times the current scale; the identity when disabled.

    torch's ``scaler.scale(loss)``: call it inside the function you differentiate, so that the gradients
    ``tx.update`` gets are scaled. A 0-dim loss promotes to float32 (a float16 or bfloat16 loss too, so the
    scaled loss never lives in half precision); a floating array with dimensions keeps its dtype, computed
    in float32 and rounded once, as torch does.

    Args:
        loss_or_tree: the loss, or a pytree of outputs (arrays or Python numbers).
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it (the one
            passed to ``tx.update`` with the gradients).

    Returns:
        ``loss_or_tree`` times the scale, leaf by leaf; ``loss_or_tree`` itself when the scaler is disabled.

    Raises:
        ValueError: when ``opt_state`` holds no scaler state, or more than one.
        TypeError: when the arguments are swapped.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> jamp.scale(jnp.float32(2.0), opt_state)  # the default scale is 2**16
        Array(131072., dtype=float32)
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> grads = jax.grad(lambda p: jamp.scale(loss_fn(p), opt_state))(params)
    """
    scaler_state.refuse_swapped(opt_state, loss_or_tree, "jamp.scale(opt_state, loss)", "jamp.scale(loss, opt_state)")
    return _scaled(loss_or_tree, opt_state)


def unscale(grads: Any, opt_state: Any) -> Any:
    """The scaled gradients divided by the scale that produced them, as ``tx.update`` divides them.

    For what you log or inspect (a gradient norm), not for ``tx.update``. torch's
    ``scaler.unscale_(optimizer)`` divides the gradients in place and its ``step`` then skips the division;
    ``tx.update`` always divides what it gets, so hand it the *scaled* gradients: gradients passed through
    ``jamp.unscale`` first would be divided twice (each step 65536 times too small at the default scale; jamp
    warns with :class:`jamp.UnscaledGradientsWarning` when it sees that in the jitted step). To clip the
    unscaled gradients, put the clip inside the scaler instead:
    ``jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))``.

    Args:
        grads: the gradients of ``jamp.scale(loss, opt_state)``, any pytree.
        opt_state: the optimizer state whose scale multiplied the loss (the one given to ``jamp.scale``).

    Returns:
        ``grads`` with every floating leaf times ``float32(1/scale)`` (computed without overflow or flush, as
        :func:`jamp_kernels.inverse`) in float32, float64 leaves in float64, rounded once to the leaf's dtype;
        integer leaves as they are. ``grads`` itself when the scaler is disabled. On a step whose scaled
        gradients overflowed they hold inf/NaN, and ``tx.update`` skips that step.

    Raises:
        ValueError: for a replicated state (one scale per replica): call it inside the ``pmap`` or
            ``shard_map`` that runs the step. Also when ``opt_state`` holds no scaler state, or more than one.
        TypeError: when the arguments are swapped.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> grads = jax.grad(lambda p: jamp.scale(loss_fn(p), opt_state))(params)
        >>> print(optax.tree.norm(jamp.unscale(grads, opt_state)))  # log this
        3.4641016
        >>> updates, opt_state = tx.update(grads, opt_state, params)  # the scaled grads
    """
    scaler_state.refuse_swapped(opt_state, grads, "jamp.unscale(opt_state, grads)", "jamp.unscale(grads, opt_state)")
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return grads
    if jnp.ndim(st.scale):
        raise ValueError(
            f"jamp.unscale: this scaler state is replicated (its scale has shape {jnp.shape(st.scale)}, one per "
            "replica); call jamp.unscale inside the pmap or shard_map that runs the step, where each replica "
            "holds one scale"
        )
    return jamp_kernels.unscale(grads, jamp_kernels.inverse(st.scale))


def get_scale(opt_state: Any) -> jax.Array:
    """The current scale as a float32 array (1.0 when disabled): torch's ``scaler.get_scale()``.

    ``float(...)`` it for torch's Python float (outside ``jax.jit``). Also unwraps the variables of an
    ``nnx.Optimizer``'s state. On a concrete state (outside ``jax.jit``: the read a training loop logs) it
    also reads whether a skip episode is under way and warns :class:`jamp.SkippedStepsWarning` if so; inside
    ``jax.jit`` it reads nothing.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it.

    Returns:
        A float32 scalar array (one per replica for a replicated state).

    Raises:
        ValueError: when ``opt_state`` holds no scaler state, or more than one.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> jamp.get_scale(opt_state)
        Array(65536., dtype=float32)
        >>> float(jamp.get_scale(opt_state))
        65536.0
    """
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return jnp.ones((), jnp.float32)
    skip_report.warn_if_in_episode(opt_state, st, stacklevel=2)
    return jnp.asarray(st.scale)


def scaler_summary(opt_state: Any) -> dict[str, Any]:
    """What a logger records of the scaler, as Python numbers; warns while a skip episode is under way.

    An explicit read (it waits for the device): ``scale``, ``found_inf`` (the last update was skipped),
    ``skipped_steps`` (updates skipped in a row now), ``skip_episodes`` (runs of skips that reached
    ``warn_after_skips`` or took the scale below ``warn_below_scale``, so far) and ``in_episode``. Warns
    :class:`jamp.SkippedStepsWarning`, naming where in ``opt_state`` the scaler sits, while an episode is
    under way. A replicated state (``jax.pmap``, ``vmap``) gives a list per key, one value per replica.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it (concrete
            arrays or their NumPy host copies, not inside ``jax.jit``).

    Returns:
        A dict with the keys above; a disabled scaler's is ``{"scale": 1.0, "found_inf": False,
        "skipped_steps": 0, "skip_episodes": 0, "in_episode": False}``.

    Raises:
        ValueError: when ``opt_state`` holds no scaler state, or more than one.
        TypeError: inside ``jax.jit``.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> _, opt_state = tx.update({"w": jnp.full(3, jnp.inf)}, opt_state, params)
        >>> summary = jamp.scaler_summary(opt_state)
        >>> summary["scale"], summary["found_inf"], summary["skipped_steps"]
        (32768.0, True, 1)
    """
    return skip_report.summary(opt_state, stacklevel=2)


def found_inf(opt_state: Any) -> jax.Array:
    """True when the last update saw inf/NaN and skipped ``inner`` (always False when disabled).

    What a training loop logs to count skipped steps; ``opt_state.consecutive_skips`` counts the current
    run of them.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it.

    Returns:
        A bool scalar array (one per replica for a replicated state); False after ``tx.init``.

    Raises:
        ValueError: when ``opt_state`` holds no scaler state, or more than one.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> grads = {"w": jnp.array([1.0, jnp.inf, 0.0])}
        >>> _, opt_state = tx.update(grads, opt_state, params)
        >>> jamp.found_inf(opt_state)  # the step was skipped
        Array(True, dtype=bool)
        >>> jamp.get_scale(opt_state)  # and the scale backed off from 2**16
        Array(32768., dtype=float32)
    """
    st = scaler_state.find(opt_state)
    return jnp.zeros((), jnp.bool_) if isinstance(st, DisabledScalerState) else jnp.asarray(st.found_inf)


def set_scale(opt_state: Any, new_scale: Any) -> Any:
    """torch's ``update(new_scale)``: the scale becomes ``float32(new_scale)``, the tracker is untouched.

    Like torch, the value is not range-checked; it may be a traced scalar. It must have one element (torch
    accepts a float or a one-element tensor); a replicated state gets it on every replica. A no-op when
    disabled.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it.
        new_scale: the new scale: a Python number, or an array with one element (traced inside ``jax.jit``).

    Returns:
        A new ``opt_state`` whose scaler state has the new scale (``opt_state`` itself when disabled).

    Raises:
        ValueError: when ``new_scale`` has more than one element, or ``opt_state`` holds no scaler state or
            more than one.
        TypeError: when the arguments are swapped.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> opt_state = jamp.set_scale(opt_state, 1024.0)
        >>> jamp.get_scale(opt_state)
        Array(1024., dtype=float32)
    """
    scaler_state.refuse_swapped(
        opt_state, new_scale, "jamp.set_scale(new_scale, opt_state)", "jamp.set_scale(opt_state, new_scale)"
    )
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return opt_state
    value = jnp.asarray(new_scale, jnp.float32)
    if value.size != 1:
        raise ValueError(f"new_scale must be a scalar or a one-element array, got shape {value.shape}")
    return scaler_state.replace(opt_state, st._replace(scale=jnp.broadcast_to(value.reshape(()), jnp.shape(st.scale))))


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad`` of the scaled loss, returning the unscaled loss.

    A shorthand for differentiating ``jamp.scale(loss, opt_state)`` with the loss as auxiliary output, the
    form the docs teach (Equinox and NNX users call ``jamp.scale`` inside
    ``eqx.filter_value_and_grad``/``nnx.value_and_grad`` the same way).

    ``jamp.value_and_grad(loss_fn, argnums, has_aux)(opt_state, *args, **kwargs)`` returns
    ``(loss, scaled_grads)`` (``((loss, aux), scaled_grads)`` with ``has_aux``): ``loss`` is what
    ``loss_fn(*args, **kwargs)`` returned, in its own dtype, and ``scaled_grads`` are the gradients of
    ``jamp.scale(loss, opt_state)`` with respect to ``args[argnums]``, ready for the scaler's ``update``.
    ``argnums`` counts ``args`` only; ``opt_state`` is never differentiated.

    Args:
        fun: the loss function, ``fun(*args, **kwargs)``; it returns a scalar loss, or ``(loss, aux)`` with
            ``has_aux``.
        argnums: the position (or positions) in ``args`` of the arguments to differentiate, as in
            ``jax.value_and_grad``.
        has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
        A function ``(opt_state, *args, **kwargs) -> (loss, scaled_grads)`` (``((loss, aux), scaled_grads)``
        with ``has_aux``). It raises a TypeError when its first argument holds no scaler state.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> loss, grads = jamp.value_and_grad(loss_fn)(opt_state, params)
        >>> loss, grads["w"]  # the loss as fun returns it; the scaled loss's gradients
        (Array(3., dtype=float32), Array([131072., 131072., 131072.], dtype=float32))
        >>> updates, opt_state = tx.update(grads, opt_state, params)
    """

    def grads_of(opt_state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not scaler_state.all_states(opt_state) and not scaler_state.restored_without_target(opt_state):
            raise TypeError(
                f"jamp.value_and_grad({getattr(fun, '__name__', 'loss_fn')})(opt_state, *args): the first argument "
                f"must be the optimizer state that holds the jamp.scaler state (tx.init(params)), got a "
                f"{type(opt_state).__name__} that holds none. Call it as jamp.value_and_grad(loss_fn)(opt_state, "
                "params, batch), where loss_fn(params, batch) returns the loss"
            )

        def scaled(*a: Any, **k: Any):
            out = fun(*a, **k)
            loss = out[0] if has_aux else out
            return _scaled(loss, opt_state), out

        (_, out), grads = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)(*args, **kwargs)
        return out, grads

    return grads_of
