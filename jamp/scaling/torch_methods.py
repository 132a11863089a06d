"""What :func:`jamp.scaler` returns: an optax transformation that answers torch's GradScaler methods.

``tx.step``, ``tx.scale``, ``tx.unscale_`` are habits from torch's ``scaler.step(optimizer)``: the error for each
says what to write with an optax transformation and its state.
"""

from __future__ import annotations

import optax

# torch GradScaler method -> what to write with tx = jamp.scaler(...) (the state is opt_state = tx.init(params))
SCALER_METHODS: dict[str, str] = {
    "scale": "jamp.scale(loss, opt_state), inside the function you differentiate",
    "step": (
        "updates, opt_state = tx.update(grads, opt_state, params), then optax.apply_updates(params, updates): "
        "it unscales, checks for inf/NaN, steps or skips and moves the scale (step and update in one call)"
    ),
    "unscale_": (
        "not needed: tx.update unscales before the optimizer it wraps runs, so a clip inside it sees "
        "unscaled gradients: jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3)). To log the unscaled "
        "gradients (a norm), jamp.unscale(grads, opt_state) returns them, and tx.update still gets the scaled "
        "grads: it divides what it gets, so unscaled ones would be divided twice"
    ),
    "get_scale": "jamp.get_scale(opt_state)",
    "is_enabled": "jamp.state_dict(opt_state) != {}",
    "state_dict": "jamp.state_dict(opt_state)",
    "load_state_dict": "opt_state = jamp.load_state_dict(opt_state, sd)",
    **{
        f"get_{name}": f"jamp.state_dict(opt_state)[{name!r}]"
        for name in ("growth_factor", "backoff_factor", "growth_interval")
    },
    **{
        f"set_{name}": f"opt_state = jamp.load_state_dict(opt_state, {{**jamp.state_dict(opt_state), {name!r}: value}})"
        for name in ("growth_factor", "backoff_factor", "growth_interval")
    },
}


class ScalerTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`jamp.scaler` returns: an optax transformation that answers torch's GradScaler methods.

    Its missing attributes that are GradScaler methods (``tx.step``, ``tx.scale``, ``tx.unscale_``) fail with
    the jamp form. It is an ``optax.GradientTransformationExtraArgs``: it goes wherever an optax optimizer goes
    (``optax.MultiSteps``, ``nnx.Optimizer``, ...), and its ``update`` passes extra keyword arguments on to
    the optimizer it wraps.

    Attributes:
        init: ``init(params)``: the first :class:`jamp.ScalerState` (a :class:`jamp.DisabledScalerState` when
            the scaler is disabled).
        update: ``update(scaled_grads, opt_state, params=None, **extra)``: ``(updates, new_opt_state)``; it
            unscales, checks for inf/NaN, steps or skips the wrapped optimizer, and moves the scale.

    Examples:
        >>> import optax, jamp
        >>> tx = jamp.scaler(optax.adam(1e-3))
        >>> isinstance(tx, optax.GradientTransformationExtraArgs)
        True
        >>> tx.step  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        AttributeError: ... torch's scaler.step is updates, opt_state = tx.update(...
    """

    __slots__ = ()

    def __getattr__(self, name: str):
        hint = SCALER_METHODS.get(name)
        message = (
            f"jamp.scaler(...).{name}: torch's scaler.{name} is {hint}"
            if hint
            else f"{type(self).__name__!r} object has no attribute {name!r}"
        )
        raise AttributeError(message, name=name, obj=self)
