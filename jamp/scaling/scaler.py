"""``jamp.scaler``: torch's ``GradScaler`` as an optax transformation that wraps the optimizer it guards.

It wraps rather than chains because a skipped step must leave the optimizer's state untouched: an
element placed first in ``optax.chain`` can zero the updates but cannot stop the later elements from
advancing their counts and moments.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jamp_kernels
from jamp._arguments import checked_bool, checked_transformation
from jamp.scaling import guards, lint, scale_update, skip, skip_episodes
from jamp.scaling import state as scaler_state
from jamp.scaling.state import DisabledScalerState, ScalerState
from jamp.scaling.torch_methods import ScalerTransformation
from jamp_kernels import leafwise

_BACKENDS = ("auto", "xla", "pallas", "interpret")


def _combine(found_inf: jax.Array, axis_name: Hashable | tuple | None) -> jax.Array:
    """Every replica along ``axis_name`` takes the same decision (torch's ShardedGradScaler all-reduce).

    A name that is not bound, or gradients that still vary over a manual axis ``axis_name`` leaves out,
    would give some replicas another decision: both are errors at trace time that say what to pass.
    """
    if axis_name is None:
        return found_inf
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"jamp.scaler(axis_name={axis_name!r}): axis {name!r} is not bound where tx.update is traced; "
                "axis_name names the pmap axis or the shard_map mesh axes the gradients vary over; under "
                "jax.jit with sharded arrays leave axis_name=None"
            ) from None
    combined = jax.lax.psum(found_inf.astype(jnp.int32), axis_name) > 0
    varying = jax.typeof(combined).manual_axis_type.varying
    if varying:
        raise ValueError(
            f"jamp.scaler(axis_name={axis_name!r}): the gradients also vary over {sorted(varying)}; "
            f"pass axis_name={names + tuple(sorted(varying))!r}"
        )
    return combined


_IDENTITY_UPDATE = optax.identity().update.__code__  # every optax.identity() shares its update's code


def _is_identity(tx: Any) -> bool:
    return getattr(tx.update, "__code__", None) is _IDENTITY_UPDATE


def _refuse_opt_state_as_params(params: Any) -> None:
    if scaler_state.all_states(params):
        raise TypeError(
            "jamp.scaler's tx.init(params) got a tree that holds a jamp.scaler state: it takes the parameters the "
            "optimizer updates. An opt_state is made once, opt_state = tx.init(params), and then comes back from "
            "updates, opt_state = tx.update(grads, opt_state, params)"
        )


def _check_inner(inner: tuple) -> optax.GradientTransformationExtraArgs:
    if not inner:
        raise TypeError(
            "jamp.scaler() needs the optimizer it guards: write jamp.scaler(optax.adam(1e-3)) or "
            "jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), not "
            "optax.chain(jamp.scaler(), ...): a scaler placed first in a chain could zero the updates of an "
            "overflowing step but not stop the later transformations from updating their state"
        )
    for i, tx in enumerate(inner):
        checked_transformation(f"jamp.scaler's argument {i}", tx)
    if all(map(_is_identity, inner)):
        warnings.warn(
            "jamp.scaler(optax.identity()) guards no optimizer: the scaler wraps the optimizer it protects, so "
            "that a skipped step leaves that optimizer's state untouched. Write jamp.scaler(optax.adam(1e-3)) (or "
            "jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))), not optax.chain(jamp.scaler("
            "optax.identity()), optax.adam(1e-3)), where a skipped step still advances Adam's count and decays "
            "its moments",
            stacklevel=3,
        )
    return optax.with_extra_args_support(inner[0] if len(inner) == 1 else optax.chain(*inner))


def scaler(
    inner: optax.GradientTransformation | None = None,
    *more: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    axis_name: Hashable | tuple | None = None,
    backend: str = "auto",
    min_scale: float | None = None,
    max_scale: float | None = None,
    warn_after_skips: int | None = 32,
    warn_below_scale: float | None = 1.0,
    **unknown: Any,
) -> ScalerTransformation:
    """Dynamic loss scaling around ``inner`` (several transformations are chained), as torch's GradScaler.

    ``update(scaled_grads, state, params, **extra)`` unscales by ``float32(1/scale)`` in float32 (float64
    leaves in float64), looks for inf/NaN in the scaled grads (combined over ``axis_name`` when given),
    then either applies ``inner`` or returns zero updates with ``inner``'s state bit-identical, and moves
    the scale by torch's ``_amp_update_scale_`` rule (:mod:`jamp.scaling.scale_update`). Produce the scaled grads
    by differentiating ``jamp.scale(loss, opt_state)`` inside the function you take the gradient of.
    The unscale is plain jnp that XLA fuses into ``inner``. The skip is a select, not a ``lax.cond``, in the
    form that is fastest on the platform the step is lowered for (see :mod:`jamp.scaling.skip`).

    Beyond torch, which says nothing, the scaler warns (:class:`jamp.SkippedStepsWarning`, once per episode)
    when ``warn_after_skips`` updates in a row were skipped or a backoff takes the scale below
    ``warn_below_scale`` (:mod:`jamp.scaling.skip_episodes` says why 32 and 1.0); None turns a condition off.
    The step only counts episodes in its state, with no callback or conditional; the reads a loop logs with
    say so (:func:`jamp.get_scale`, :func:`jamp.scaler_summary`, :func:`jamp.report_skipped_steps`).

    Unlike torch, where several optimizers share one GradScaler and each skips on its own overflow, one
    jamp.scaler takes one decision: wrap ``optax.multi_transform`` to skip all groups together, or give
    each group its own scaler (then each has its own scale).

    Put what you would chain with it inside it: ``jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))``
    clips the unscaled gradients (torch's ``unscale_`` before ``clip_grad_norm_``), while
    ``optax.chain(optax.clip_by_global_norm(1.0), jamp.scaler(optax.adam(1e-3)))`` clips the scaled ones and
    cuts every step to almost nothing; what is chained after the scaler with a state advances on skipped steps.
    Only transformations that map a zero update to zero, with no state, may follow it in a chain
    (``optax.add_decayed_weights`` may not: it would move the parameters on skipped steps). Accumulate with
    ``jamp.scaler(optax.MultiSteps(opt, k))``, not ``optax.MultiSteps(jamp.scaler(opt), k)``, which an overflow
    stops for good on optax 0.2.8. ``tx.update`` takes the *scaled* gradients: unscale only what you log
    (``jamp.unscale(grads, opt_state)``). :func:`jamp.check_step` finds each of these (a lint run once).
    While ``update`` is traced, the scaler refuses an optimizer that communicates over a mapped axis
    ``axis_name`` does not name, and warns about float16 parameters under an optimizer that is neither
    :func:`jamp.kahan_summation` nor :func:`jamp.stochastic_rounding` (:mod:`jamp.scaling.guards`).

    Args:
        inner: the optax transformation the scaler guards (the optimizer); required.
        *more: further transformations, chained after ``inner`` inside the scaler
            (``jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))``).
        init_scale: the first scale, a finite float > 0 (rounded to float32, as torch), inside
            ``[min_scale, max_scale]``.
        growth_factor: what the scale is multiplied by after ``growth_interval`` clean steps, a finite
            float > 1.0 (applied in double precision, as torch).
        backoff_factor: what the scale is multiplied by on a step with inf/NaN, a float in (0, 1).
        growth_interval: clean steps in a row after which the scale grows, an int >= 1.
        enabled: False applies ``inner`` on every step, validates nothing but ``inner``, and makes
            ``jamp.scale`` the identity (torch's ``GradScaler(enabled=False)``).
        axis_name: None, or the ``pmap`` axis or ``shard_map`` mesh axes (a name or a tuple) the gradients
            vary over: every replica then takes the same decision (torch's ShardedGradScaler). Under
            ``jax.jit`` with sharded arrays leave it None.
        backend: the finite check (``jamp_kernels.has_nonfinite``): "auto" (one Pallas kernel launch over
            all leaves on CUDA, XLA elsewhere: on a CPU elementwise loops over views of the gradients, see
            ``jamp_kernels.xla.CHECK_OF_PLATFORM``), "xla", "pallas", "interpret".
        min_scale: None (no floor, as torch), or a finite float > 0 that a backoff never goes below; an
            extra beyond torch.
        max_scale: None (no ceiling, as torch), or a finite float > 0 that growth never goes above; an extra
            beyond torch.
        warn_after_skips: warn when this many updates in a row were skipped (an int >= 1), or None.
        warn_below_scale: warn when a backoff takes the scale below this finite float > 0, or None.
        **unknown: no other keyword is taken; each gets a TypeError that says what to write.

    Returns:
        A :class:`jamp.ScalerTransformation`: ``init(params)`` makes a :class:`jamp.ScalerState`
        (:class:`jamp.DisabledScalerState` when disabled) and ``update(scaled_grads, opt_state, params=None,
        **extra)`` returns ``(updates, opt_state)``.

    Raises:
        TypeError: without ``inner``, for an argument that is not an optax transformation, a hyperparameter
            of the wrong type (a bool, a string, a traced value, an array as ``optax.inject_hyperparams``
            passes), an unknown keyword (torch's ``device=`` answered).
        ValueError: for a hyperparameter out of its range, ``min_scale > max_scale``, or an unknown
            ``backend``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> def loss_fn(p):
        ...     return jnp.sum(p["w"] ** 2)
        >>> scaled_loss_fn = lambda p: jamp.scale(loss_fn(p), opt_state)
        >>> grads = jax.grad(scaled_loss_fn)(params)  # the scaled loss's gradients
        >>> updates, opt_state = tx.update(grads, opt_state, params)
        >>> updates["w"]  # -0.1 times the unscaled gradient 2.0
        Array([-0.2, -0.2, -0.2], dtype=float32)
        >>> params = optax.apply_updates(params, updates)
    """
    guards.refuse_unknown_keywords(unknown, locals())
    inner_tx = _check_inner(() if inner is None else (inner, *more))
    if not checked_bool("enabled", enabled):
        return _disabled(inner_tx)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    hp = {
        **scaler_state.torch_hyperparams(
            growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval
        ),
        **scaler_state.bounds(min_scale, max_scale),
        **skip_episodes.thresholds(warn_after_skips, warn_below_scale),
    }
    scale0 = scaler_state.checked_init_scale(init_scale, hp)

    def init(params: optax.Params) -> ScalerState:
        _refuse_opt_state_as_params(params)
        return ScalerState(
            scale=jnp.asarray(scale0),
            growth_tracker=jnp.zeros((), jnp.int32),
            **scaler_state.as_arrays(hp),
            found_inf=jnp.zeros((), jnp.bool_),
            **skip_episodes.initial_fields(),
            inner_state=inner_tx.init(params),
        )

    def update(grads: optax.Updates, state: ScalerState, params: optax.Params | None = None, **extra: Any):
        scaler_state.refuse_foreign(state, params, ScalerState)
        lint.note_update(state, grads)
        found_inf = _combine(jamp_kernels.has_nonfinite(grads, backend=backend), axis_name)
        # == float32(1 / float64(scale)) (tests/scaling/test_scaler_torch.py), kept normal above 2**126. XLA fuses
        # the unscale into inner's loops; zeroing a skipped step's grads means the computation that is
        # discarded never sees inf/NaN (an SVD of an inf matrix may never return).
        unscaled = jamp_kernels.unscale(grads, jamp_kernels.inverse(state.scale))
        zeros = leafwise.Spread()  # -0.0 once per shape, shared with the zeroed updates of a skipped step
        finite = jax.tree.map(lambda g: skip.zero_where(found_inf, g, zeros), unscaled)
        traced = skip.trace(inner_tx.update, finite, state.inner_state, params, extra)
        guards.refuse_unnamed_collectives(traced.closed.jaxpr, axis_name)
        guards.warn_low_precision_params(grads, [a.dtype for a in traced.closed.out_avals[: traced.n_updates]])
        updates, inner_state = skip.step_or_skip(traced, found_inf, state.inner_state, zeros)
        scale, tracker = scale_update.next_scale(state, found_inf)
        episode = skip_episodes.track(state, found_inf, scale)
        return updates, state._replace(
            scale=scale, growth_tracker=tracker, found_inf=found_inf, inner_state=inner_state, **episode
        )

    return ScalerTransformation(init, update)


def _disabled(inner_tx: optax.GradientTransformationExtraArgs) -> ScalerTransformation:
    """torch's disabled GradScaler: ``step`` is ``optimizer.step``, nothing else happens."""

    def init(params):
        _refuse_opt_state_as_params(params)
        return DisabledScalerState(inner_tx.init(params))

    def update(grads, state, params=None, **extra):
        scaler_state.refuse_foreign(state, params, DisabledScalerState)
        updates, inner_state = inner_tx.update(grads, state.inner_state, params, **extra)
        return updates, DisabledScalerState(inner_state)

    return ScalerTransformation(init, update)
