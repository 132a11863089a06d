"""The scaler's state: a pytree of arrays, its validated hyperparameters, and where it sits in an opt_state.

Every number lives in the state as an array, so changing a hyperparameter (``load_state_dict``) recompiles
nothing and ``jit``, ``tree_map`` and orbax carry all of it (jmp lost ``min_loss_scale`` that way). Arrays
are made only by ``init``, never at import time (mpx broke ``jax.distributed.initialize`` that way).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp._arguments import shown
from jamp.scaling import exact_mul

_INT32_MAX = 2**31 - 1


class ScalerState(NamedTuple):
    """State of an enabled :func:`jamp.scaler` (torch ``GradScaler``'s ``_scale``/``_growth_tracker`` and config).

    ``warn_after_skips``, ``warn_below_scale``, ``consecutive_skips``, ``warned`` and ``skip_episodes`` are
    jamp's: the skipped-steps report (:mod:`jamp.scaling.skip_episodes` counts on the device;
    :func:`jamp.report_skipped_steps`, :func:`jamp.get_scale` and :func:`jamp.scaler_summary` read them when
    asked). The state is a plain NamedTuple, inert like optax's states: a function of the hyperparameters and
    the gradients it saw, nothing else (identically configured scalers make bit-identical states).
    ``growth_factor`` and ``backoff_factor`` are the IEEE-754 doubles of the Python floats as ``uint32[2]``
    (high word, low word): torch multiplies the scale by them in double precision, and JAX without x64 has
    no double. ``jamp.state_dict`` shows them as floats.

    ``tx.init`` makes it and ``tx.update`` returns the next one; read it with :func:`jamp.get_scale`,
    :func:`jamp.found_inf` and :func:`jamp.state_dict`. Every field is an array, so ``jit``, ``tree_map`` and
    orbax carry all of it. The shapes below are one state's; a replicated state (``jax.pmap(tx.init)``) has
    the replica axes in front of each.

    Attributes:
        scale: f32[]: the scale the next loss is multiplied by.
        growth_tracker: i32[]: clean steps since the last growth or backoff (torch's ``_growth_tracker``).
        growth_factor: u32[2]: the bits of the double ``growth_factor`` (high word, low word).
        backoff_factor: u32[2]: the bits of the double ``backoff_factor`` (high word, low word).
        growth_interval: i32[]: clean steps after which the scale grows.
        min_scale: f32[]: backoff never goes below it (0: no floor, as torch).
        max_scale: f32[]: growth never goes above it (inf: no ceiling, as torch).
        found_inf: bool[]: the last update saw inf/NaN and was skipped.
        warn_after_skips: i32[]: a run of this many skips starts an episode (0: never).
        warn_below_scale: f32[]: a backoff below this scale starts an episode (0: never).
        consecutive_skips: i32[]: updates skipped in a row (0 after a step that was taken).
        warned: bool[]: this run of skips started an episode (:class:`jamp.SkippedStepsWarning`); cleared
            by a step taken.
        skip_episodes: i32[]: episodes so far (runs of skips that reached a ``warn_*`` threshold); never
            reset.
        inner_state: the state of the optimizer the scaler wraps.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> opt_state = jamp.scaler(optax.adam(1e-3)).init({"w": jnp.ones(3)})
        >>> opt_state.scale, opt_state.growth_tracker, opt_state.found_inf
        (Array(65536., dtype=float32), Array(0, dtype=int32), Array(False, dtype=bool))
        >>> opt_state.inner_state[0].count  # Adam's state
        Array(0, dtype=int32)
    """

    scale: jax.Array  # f32[]: the scale the next loss is multiplied by
    growth_tracker: jax.Array  # i32[]: clean steps since the last growth or backoff
    growth_factor: jax.Array  # u32[2]: double bits
    backoff_factor: jax.Array  # u32[2]: double bits
    growth_interval: jax.Array  # i32[]
    min_scale: jax.Array  # f32[]: backoff never goes below (0: no floor, as torch)
    max_scale: jax.Array  # f32[]: growth never goes above (inf: no ceiling, as torch)
    found_inf: jax.Array  # bool[]: the last update saw inf/NaN and was skipped
    warn_after_skips: jax.Array  # i32[]: a run of this many skips starts an episode (0: never)
    warn_below_scale: jax.Array  # f32[]: a backoff below this scale starts an episode (0: never)
    consecutive_skips: jax.Array  # i32[]: updates skipped in a row (0 after a step that was taken)
    warned: (
        jax.Array
    )  # bool[]: this run of skips started an episode (jamp.SkippedStepsWarning); cleared by a step taken
    skip_episodes: jax.Array  # i32[]: episodes so far (runs of skips that reached a warn_* threshold); never reset
    inner_state: optax.OptState


class DisabledScalerState(NamedTuple):
    """State of ``jamp.scaler(..., enabled=False)``: only the inner state; scale() is the identity.

    With it, ``jamp.scale`` and ``jamp.unscale`` return what they get, ``jamp.get_scale`` returns 1.0,
    ``jamp.found_inf`` False and ``jamp.state_dict`` ``{}``; ``tx.update`` is the inner optimizer's.

    Attributes:
        inner_state: the state of the optimizer the scaler wraps.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> tx = jamp.scaler(optax.adam(1e-3), enabled=False)
        >>> opt_state = tx.init({"w": jnp.ones(3)})
        >>> type(opt_state).__name__, opt_state.inner_state[0].count
        ('DisabledScalerState', Array(0, dtype=int32))
        >>> jamp.scale(jnp.float32(2.0), opt_state), jamp.get_scale(opt_state)
        (Array(2., dtype=float32), Array(1., dtype=float32))
    """

    inner_state: optax.OptState


def refuse_traced(name: str, value: Any) -> None:
    """A TypeError when ``value`` is a tracer: the hyperparameters are validated as Python numbers on the host,
    so they cannot come from inside ``jax.jit`` (``jamp.load_state_dict`` of a state dict passed to a jitted
    function)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value ({value.aval.str_short()}): jamp checks it as a Python number on the host, "
            "so jamp.load_state_dict and jamp.scaler cannot take it from inside jax.jit. Call them outside jit "
            "with Python numbers (the dict jamp.state_dict returns), or close over the dict instead of passing it "
            "as an argument; to set the scale to a traced value inside a step, write "
            "opt_state = jamp.set_scale(opt_state, new_scale)"
        )


def real(name: str, value: Any) -> float:
    """``value`` as a Python float; TypeError naming ``name`` for bools, tracers and non-numbers.

    An int too large for a float (``10**400``) becomes +-inf, so the caller's range check names it.
    """
    refuse_traced(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {shown(value)} of type {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def f32(value: float) -> np.float32:
    """Round to float32 as torch's ``fill_`` does; too large becomes inf (no warning)."""
    with np.errstate(over="ignore"):
        return np.float32(value)


# name -> (test on the float value, what is allowed): the constructor's and load_state_dict's checks.
_SCALE_RULE = (lambda v: math.isfinite(f32(v)) and f32(v) > 0, "a finite float > 0 (in float32)")
_FLOAT_RULES = {
    "init_scale": _SCALE_RULE,
    "scale": _SCALE_RULE,  # load_state_dict's key
    "growth_factor": (lambda v: math.isfinite(v) and v > 1.0, "a finite float > 1.0"),
    "backoff_factor": (lambda v: 0.0 < v < 1.0, "a float in (0, 1)"),
    "min_scale": (lambda v: math.isfinite(f32(v)) and f32(v) > 0, "None or a finite float > 0 (in float32)"),
    "max_scale": (lambda v: math.isfinite(f32(v)) and f32(v) > 0, "None or a finite float > 0 (in float32)"),
    "warn_below_scale": (lambda v: math.isfinite(f32(v)) and f32(v) > 0, "None or a finite float > 0 (in float32)"),
}


def checked_float(name: str, value: Any) -> float:
    """``value`` as a float that passes ``_FLOAT_RULES[name]``, else TypeError/ValueError naming ``name``."""
    v = real(name, value)
    ok, allowed = _FLOAT_RULES[name]
    if not ok(v):
        raise ValueError(f"{name} must be {allowed}, got {shown(value)}")
    return v


def checked_int(name: str, value: Any, low: int) -> int:
    """``value`` as an int in ``[low, 2**31 - 1]`` (it is stored as int32), else TypeError/ValueError."""
    refuse_traced(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {shown(value)} of type {type(value).__name__}")
    if not low <= int(value) <= _INT32_MAX:
        raise ValueError(f"{name} must be an int in [{low}, {_INT32_MAX}], got {shown(value)}")
    return int(value)


def torch_hyperparams(*, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> dict:
    """Validated torch hyperparameters as the numpy values of their ScalerState fields."""
    return {
        "growth_factor": exact_mul.to_words(checked_float("growth_factor", growth_factor)),
        "backoff_factor": exact_mul.to_words(checked_float("backoff_factor", backoff_factor)),
        "growth_interval": np.int32(checked_int("growth_interval", growth_interval, 1)),
    }


def bounds(min_scale: Any, max_scale: Any) -> dict:
    """Validated ``min_scale``/``max_scale`` fields; None means no bound (0 and inf)."""
    lo = 0.0 if min_scale is None else checked_float("min_scale", min_scale)
    hi = math.inf if max_scale is None else checked_float("max_scale", max_scale)
    if lo > hi:
        raise ValueError(f"min_scale must be <= max_scale, got min_scale={min_scale!r} > max_scale={max_scale!r}")
    return {"min_scale": np.float32(lo), "max_scale": np.float32(hi)}


def checked_init_scale(init_scale: Any, hp: dict) -> np.float32:
    """``init_scale`` rounded to float32 (as torch's ``torch.full((), init_scale)``), inside [min, max]."""
    s = f32(checked_float("init_scale", init_scale))
    if not hp["min_scale"] <= s <= hp["max_scale"]:
        raise ValueError(f"init_scale must lie in [min_scale, max_scale], got {init_scale!r}")
    return s


def is_scaler_state(x: Any) -> bool:
    return isinstance(x, (ScalerState, DisabledScalerState))


def all_states(tree: Any) -> list[ScalerState | DisabledScalerState]:
    """Every scaler state inside ``tree``."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_scaler_state) if is_scaler_state(x)]


# The fields by which a ScalerState restored without a target (orbax gives a dict) is recognised.
_RESTORED_FIELDS = frozenset({"scale", "growth_tracker", "inner_state"})


def restored_without_target(tree: Any) -> list[str]:
    """Paths of dicts that hold a ScalerState's fields: a checkpoint restored without a target."""

    def is_restored(x: Any) -> bool:
        return isinstance(x, Mapping) and _RESTORED_FIELDS <= x.keys()

    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_restored)[0]
    return [jax.tree_util.keystr(p) or "opt_state itself" for p, x in paths if is_restored(x)]


def find(opt_state: Any) -> ScalerState | DisabledScalerState:
    """The one scaler state inside ``opt_state`` (MultiSteps, inject_hyperparams, multi_transform, chain...)."""
    found = all_states(opt_state)
    if len(found) == 1:
        return found[0]
    restored = [] if found else restored_without_target(opt_state)
    if restored:
        raise ValueError(
            f"found no jamp.scaler state in opt_state, but a dict with jamp.ScalerState's fields at "
            f"{', '.join(restored)}: a checkpoint restored without a target gives dicts for NamedTuples. Restore "
            "with a target so the structure comes back, e.g. checkpointer.restore(path, {'opt_state': "
            "tx.init(params), ...}) or, without allocating, jax.eval_shape(tx.init, params) as the target; or put "
            "what was restored into that structure with jamp.from_restored(target, restored), which also takes a "
            "checkpoint saved by a jamp without ScalerState.warn_after_skips, .warn_below_scale, .consecutive_skips, "
            ".warned or .skip_episodes (a target cannot restore those)"
        )
    given = "None" if opt_state is None else f"a {type(opt_state).__name__}"
    what = f"no jamp.scaler state (opt_state is {given})" if not found else f"{len(found)} jamp.scaler states"
    raise ValueError(
        f"expected exactly one jamp.scaler state in opt_state, found {what}; pass the optimizer state "
        "returned by jamp.scaler(...).init/update, or the part of it that holds the scaler you mean"
    )


def refuse_swapped(opt_state: Any, other: Any, call: str, form: str) -> None:
    """A TypeError that shows ``form`` when ``other`` holds the scaler state and ``opt_state`` does not: the
    arguments of ``call`` came in the wrong order."""
    if all_states(other) and not all_states(opt_state) and not restored_without_target(opt_state):
        raise TypeError(f"{call}: the arguments are swapped; write {form}")


def refuse_foreign(state: Any, params: Any, kind: type) -> None:
    """A TypeError that says what to pass when ``tx.update`` got, as its state, something other than the
    ``kind`` of state its ``init`` makes: the arguments swapped, an outer opt_state, a checkpoint restored
    without a target, another transformation's state."""
    if isinstance(state, kind):
        return
    call = "tx.update(grads, opt_state, params)"
    refuse_swapped(state, params, "tx.update(grads, params, opt_state)", call)
    if restored_without_target(state) and not all_states(state):
        find(state)  # the ValueError that shows how to restore with a target
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_scaler_state)[0]
    where = [jax.tree_util.keystr(p) for p, x in flat if is_scaler_state(x)]
    hint = f"; it holds one at opt_state{where[0]}: pass that" if where else ""
    raise TypeError(
        f"jamp.scaler's {call}: opt_state must be the {kind.__name__} that tx.init(params) returned, or the one "
        f"the last tx.update returned, got {'None' if state is None else 'a ' + type(state).__name__}{hint}"
    )


def replace(opt_state: Any, new: ScalerState | DisabledScalerState) -> Any:
    """``opt_state`` with its scaler state (located as by :func:`find`) swapped for ``new``."""
    find(opt_state)
    return jax.tree.map(lambda x: new if is_scaler_state(x) else x, opt_state, is_leaf=is_scaler_state)


def as_arrays(fields: dict) -> dict:
    """numpy field values -> jax arrays (called from init/load, never at import)."""
    return {k: jnp.asarray(v) for k, v in fields.items()}
