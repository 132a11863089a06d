"""``jamp.UnscaledGradientsWarning``: gradients of the unscaled loss handed to the scaler's ``update``, as
:func:`jamp.check_step` finds them (the walk reads JAX's tracers, so only the explicit lint runs it).

``jax.grad(loss_fn)`` where ``jax.grad(lambda p: jamp.scale(loss_fn(p), opt_state))`` was meant runs without
error: the scaler divides the gradients by the scale anyway, and every update comes out 65536 times too small.

The values cannot tell: unscaled gradients look like the scaled gradients of a smaller loss, and a check of
their magnitude on the first steps fires on every model whose gradients are small (a fine-tuning near its
optimum, a loss averaged over many tokens). The dataflow can. When ``tx.update`` is traced (by
:func:`jamp.check_step`) in the jitted function that differentiated the loss, which is how a training step is
written, the equations that computed
the gradients are recorded in that trace, and gradients of a scaled loss depend on the scale that
``tx.update`` reads. So jamp warns, while tracing (a compiled step runs nothing for it), when

* a gradient was computed in the trace ``tx.update`` runs in (seen through ``vmap``: an ensemble's step), by a
  backward pass (an equation that ``jax.grad``/``jax.vjp`` made by transposition, or such an equation inside a
  nested ``jit`` or a ``scan``), and
* no gradient depends on the scale that ``tx.update`` reads, nor on anything that scale was computed from.

Gradients computed by another jitted function, or eagerly, are inputs of the trace: nothing is claimed then,
nor where the graph is too large to walk (:data:`_MOST_TRACERS`).

The other way round, scaled gradients already divided by the scale (``jamp.unscale``, ``jamp_kernels.unscale``
or ``unscale_and_check``, ``g / jamp.get_scale(opt_state)``, torch's ``unscale_`` habit) are divided again
by ``tx.update``. Those depend on the scale twice: through the backward pass, and through an equation after it
that reads the scale's inverse. So jamp also warns when a gradient was computed, by equations that no backward
pass made, from a value that divides by the scale ``tx.update`` reads (a ``div`` by it, a negative power of
it: :data:`_INVERTING`) an odd number of times. Scaled gradients multiplied by a factor made from the true
norm (a clip, ``g * min(1, c / norm(jamp.unscale(g)))``) divide by the scale twice, which cancels, and a gate
(``g * (norm < c)``) compares: a comparison carries no magnitude, so the walk stops there.
"""

from __future__ import annotations

from typing import Any

import jax

from jamp import _jax_compat as jc

_MOST_TRACERS = 2_000_000  # the walk gives up (and claims nothing) past this many tracers


class UnscaledGradientsWarning(UserWarning):
    """``tx.update`` of a ``jamp.scaler`` got gradients that are not scaled.

    They are the gradients of a loss that ``jamp.scale`` did not multiply, or gradients already divided by the
    scale (``jamp.unscale``: for logging, not for ``tx.update``).

    Gradients of an unscaled loss would come out of ``tx.update`` 65536 times too small at the default
    ``init_scale``, and so would gradients divided twice. :func:`jamp.check_step` warns with it (the lint
    traces the step; a compiled step runs nothing for it) when ``tx.update`` is traced in the function that
    differentiated the loss and the dataflow shows either: no gradient depends on the scale, or one was
    computed after the backward pass from a value that divides by it. Gradients computed elsewhere (another
    jitted function, eagerly) are not judged.

    Examples:
        >>> import warnings, jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)  # jamp.scale forgotten
        >>> def step(params, opt_state):
        ...     grads = jax.grad(loss_fn)(params)
        ...     return tx.update(grads, opt_state, params)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     found = jamp.check_step(step, params, tx.init(params))
        >>> [w.category.__name__ for w in caught]
        ['UnscaledGradientsWarning']
    """


def _sources(x: Any, most: int = 10_000) -> set[int] | None:
    """ids of ``x`` and of every tracer it was computed from in the trace under way; None past ``most``."""
    seen: set[int] = set()
    stack = [x]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if len(seen) > most:
            return None
        eqn = jc.producer(t)
        if eqn is not None:
            stack.extend(jc.producer_inputs(eqn))
    return seen


def differentiated_without(grads: Any, scale: Any) -> bool:
    """True when ``grads`` were made by a backward pass in the trace ``scale`` belongs to and none of them depends
    on ``scale`` (or on what it was computed from). False whenever that cannot be known."""
    scale = jc.unbatched(scale)
    trace = jc.jaxpr_trace_of(scale)
    if trace is None:
        return False
    leaves = [g for g in map(jc.unbatched, jax.tree.leaves(grads)) if jc.jaxpr_trace_of(g) is trace]
    scale_sources = _sources(scale) if leaves else None
    if scale_sources is None:
        return False
    seen: set[int] = set()
    checked_eqns: set[int] = set()
    stack, backward = list(leaves), False
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        if id(t) in scale_sources or len(seen) >= _MOST_TRACERS:
            return False
        seen.add(id(t))
        eqn = jc.producer(t)
        if eqn is None:
            continue
        if not backward and id(eqn) not in checked_eqns:
            checked_eqns.add(id(eqn))
            backward = jc.made_by_backward_pass(eqn)
        stack.extend(jc.producer_inputs(eqn))
    return backward


# primitive -> the positions of the inputs it divides by (given the equation: integer_pow depends on its power)
_INVERTING = {
    "div": lambda eqn: (1,),
    "integer_pow": lambda eqn: (0,) if eqn.params["y"] < 0 else (),
    "rsqrt": lambda eqn: (0,),
}


def _no_inputs(eqn: Any) -> tuple:
    return ()


# primitives whose result carries no magnitude of their inputs: a gate computed from the true norm
_GATES = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "is_finite", "sign"})


def divided_by(grads: Any, scale: Any) -> bool:
    """True when a gradient was computed, after the backward pass (by equations no backward pass made), from a
    value that divides by ``scale`` (or by what it was computed from) an odd number of times on the way, through
    no comparison. False whenever that cannot be known."""
    scale = jc.unbatched(scale)
    trace = jc.jaxpr_trace_of(scale)
    if trace is None:
        return False
    leaves = [g for g in map(jc.unbatched, jax.tree.leaves(grads)) if jc.jaxpr_trace_of(g) is trace]
    scale_sources = _sources(scale) if leaves else None
    if scale_sources is None:
        return False
    seen: set[tuple[int, bool]] = set()
    stack = [
        (g, False) for g in leaves
    ]  # (tracer, whether the path from a gradient to it divided an odd number of times)
    while stack:
        t, inverted = stack.pop()
        if (id(t), inverted) in seen:
            continue
        if len(seen) >= _MOST_TRACERS:
            return False
        seen.add((id(t), inverted))
        if id(t) in scale_sources:
            if inverted:
                return True
            continue
        eqn = jc.producer(t)
        if eqn is None or eqn.primitive.name in _GATES or jc.made_by_backward_pass(eqn):
            continue
        dividing = _INVERTING.get(eqn.primitive.name, _no_inputs)(eqn)
        stack.extend((x, inverted != (i in dividing)) for i, x in enumerate(jc.producer_inputs(eqn)))
    return False


def message(grads: Any, scale: Any) -> str | None:
    """What is wrong (at trace time) when :func:`differentiated_without` or :func:`divided_by` holds for the
    gradients ``tx.update`` got; None otherwise."""
    if differentiated_without(grads, scale):
        return (
            "jamp.scaler: tx.update got gradients that were differentiated in this jitted function without "
            "jamp.scale: they do not depend on the loss scale, which the scaler divides them by anyway, so every "
            "update comes out that much too small (65536 times at the default init_scale). Differentiate the "
            "scaled loss with the opt_state you pass to tx.update: grads = jax.grad(lambda p: "
            "jamp.scale(loss_fn(p, batch), opt_state))(params), with the loss as auxiliary output if you "
            "log it."
        )
    if divided_by(grads, scale):
        return (
            "jamp.scaler: tx.update got gradients that were already divided by the loss scale in this jitted "
            "function (jamp.unscale, jamp_kernels.unscale_and_check, g / jamp.get_scale(opt_state)): tx.update "
            "unscales the gradients it gets, so it divides them again and every update comes out that much too "
            "small (65536 times at the default init_scale). Hand tx.update the scaled gradients, and unscale only "
            "what you log: norm = optax.tree.norm(jamp.unscale(grads, opt_state)); updates, opt_state = "
            "tx.update(grads, opt_state, params). To clip, put the clip inside the scaler: "
            "jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))."
        )
    return None
