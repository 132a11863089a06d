"""The scaler's checks on public information, at construction or while ``tx.update`` is traced: misuse that
would otherwise train wrong in silence gets a message that names the fix.

* keywords: torch's ``GradScaler(device="cuda")`` habit, unknown keywords, and hyperparameters that arrive
  as arrays (``optax.inject_hyperparams(jamp.scaler)`` turns every number into one);
* an optimizer that communicates over a mapped axis the scaler does not name (``pmean`` of the gradients
  inside the wrapped optimizer under ``pmap``, ``axis_name`` forgotten): the replicas would take different
  skip decisions, one skipping while another applies the averaged update;
* float16 or bfloat16 parameters under an optimizer whose updates have their dtype (any but
  :func:`jamp.kahan_summation` and :func:`jamp.stochastic_rounding`, which return float32 updates), where most
  updates are lost in the rounding (torch refuses float16: "Attempting to unscale FP16 gradients").

Checks that need other libraries' frames or tracers are not here: they are the explicit lint,
:func:`jamp.check_step` (:mod:`jamp.scaling.lint`).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp._jax_compat.collectives import collective_axes

_NUMERIC = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "warn_after_skips", "warn_below_scale")
_KEYWORDS = (
    *_NUMERIC,
    "enabled",
    "axis_name",
    "backend",
    "min_scale",
    "max_scale",
)


def refuse_unknown_keywords(unknown: dict, given: dict) -> None:
    """A TypeError for keywords :func:`jamp.scaler` does not take (``device=``: torch's habit, answered) and
    for numeric hyperparameters given as arrays (what ``optax.inject_hyperparams`` passes)."""
    arrays = [k for k in _NUMERIC if isinstance(given.get(k), (jax.Array, np.ndarray))]
    if arrays:
        raise TypeError(
            f"jamp.scaler's {', '.join(arrays)} {'is an array' if len(arrays) == 1 else 'are arrays'}: the scaler "
            "checks its hyperparameters as Python numbers and keeps them as arrays in its state already (change "
            "them with jamp.load_state_dict or jamp.set_scale, no recompilation). optax.inject_hyperparams("
            "jamp.scaler) passes arrays: inject into the optimizer the scaler wraps instead, "
            "jamp.scaler(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)), then "
            "opt_state.inner_state.hyperparams['learning_rate']"
        )
    if "device" in unknown:
        raise TypeError(
            f"jamp.scaler has no device argument (torch's GradScaler(device={unknown['device']!r})): the scale "
            "lives in the optimizer state, and JAX runs the step, the check and the scale update wherever the "
            "step runs (the GPU when jax.default_backend() is 'gpu'). Write tx = jamp.scaler(optax.adam(1e-3))"
        )
    for name in unknown:
        close = difflib.get_close_matches(name, _KEYWORDS, n=1)
        hint = f"; did you mean {close[0]}=?" if close else ""
        raise TypeError(
            f"jamp.scaler() got an unexpected keyword argument {name!r}{hint} It takes the transformations it "
            f"wraps and the keywords {', '.join(_KEYWORDS)}"
        )


def refuse_unnamed_collectives(jaxpr: Any, axis_name: Hashable | tuple | None) -> None:
    """A ValueError when the wrapped optimizer's traced update communicates over a named axis (a ``pmean`` of
    the gradients under ``pmap``, a global norm under ``shard_map``) that ``axis_name`` does not name."""
    named = set() if axis_name is None else set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    missing = sorted(map(str, collective_axes(jaxpr) - named))
    if missing:
        want = tuple(sorted(map(str, named))) + tuple(missing)
        fix = repr(want[0]) if len(want) == 1 else repr(want)
        raise ValueError(
            f"jamp.scaler(axis_name={axis_name!r}): the optimizer it wraps communicates over the axis "
            f"{', '.join(map(repr, missing))} (a psum, pmean or all_gather in its update), so the replicas along "
            "it must take one skip decision: without it, one replica that saw an inf skips while the others apply "
            "the averaged update, and their parameters and scales part. Pass "
            f"jamp.scaler(..., axis_name={fix})"
        )


_LOW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def warn_low_precision_params(grads: Any, update_dtypes: list) -> None:
    """Warn (while tracing) when a gradient, and so its parameter, is float16 or bfloat16 and the wrapped
    optimizer's update for it has that dtype too: ``apply_updates`` then adds it and rounds to the nearest
    float16 (bfloat16), which loses every update below half a unit in the last place (5 Adam steps at 1e-3 on a
    26x26 regression moved 262 of 676 bfloat16 weights, SGD at 1e-2 91; float32 moved all). torch refuses
    float16 gradients outright. :func:`jamp.kahan_summation` and :func:`jamp.stochastic_rounding` return float32
    updates that land each parameter where compensated (or stochastically rounded) arithmetic puts it;
    ``update_dtypes`` are the traced update's, leaf by leaf."""
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    if len(flat) != len(update_dtypes):
        return  # an optimizer whose updates have another structure: nothing to pair
    low = [
        (jax.tree_util.keystr(p), np.dtype(u))
        for (p, g), u in zip(flat, update_dtypes)
        if np.dtype(jnp.result_type(g)) in _LOW and np.dtype(u) == np.dtype(jnp.result_type(g))
    ]
    if not low:
        return
    dtype = low[0][1].name
    shown = ", ".join(f"grads{p}" for p, _ in low[:3]) + (f" and {len(low) - 3} more" if len(low) > 3 else "")
    warnings.warn(
        f"jamp.scaler: {shown} {'is' if len(low) == 1 else 'are'} {dtype}, and so are the updates the wrapped "
        f"optimizer makes of {'it' if len(low) == 1 else 'them'}: optax.apply_updates rounds each parameter to "
        f"the nearest {dtype}, and updates below half a unit in its last place (most of them, at usual learning "
        'rates) are lost. torch refuses float16 gradients ("Attempting to unscale FP16 gradients"). Keep float32 '
        f"parameters and run the model in {dtype} with jamp.autocast, or keep the {dtype} parameters and wrap "
        "the optimizer in jamp.kahan_summation(opt, state_dtype=jnp.float32) or jamp.stochastic_rounding(opt, "
        "seed=0) inside the scaler: jamp.scaler(jamp.kahan_summation(optax.adam(1e-3), "
        "state_dtype=jnp.float32)). (A Kahan or stochastic-rounding wrapper around this scaler protects the "
        "parameters too: give it state_dtype=jnp.float32, which hands the scaler float32 copies.)",
        stacklevel=3,
    )
