"""What to write in jamp for the torch.amp names a PyTorch user tries first.

``jamp.GradScaler()`` or ``jamp.autocast("cuda")`` is a habit, not a typo, so the error says what the
jamp form is instead of only that the name is missing. The names are torch.amp's public API (torch 2.x
``torch.amp``/``torch.autocast``, the 1.x ``torch.cuda.amp`` aliases) and the loss-scaling names of the
JAX libraries people come from (jmp, flax); docs/torch-amp.md maps every API side by side.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from jamp.casting import oplists
from jamp.casting.dtypes import DTYPE_NAMES

_SCALER = (
    "the scaler is an optax transformation that wraps your optimizer: tx = jamp.scaler(optax.adam(1e-3)), "
    "opt_state = tx.init(params); in each step differentiate jamp.scale(loss, opt_state) (torch's "
    "scaler.scale(loss).backward()), then updates, opt_state = tx.update(grads, opt_state, params) "
    "unscales, checks for inf/NaN, steps or skips and moves the scale (scaler.step and scaler.update)"
)
_NO_GLOBAL_STATE = (
    "jamp keeps no global autocast state: autocast is a function transformation, and what it "
    "runs in which dtype is an argument, jamp.autocast(fn, device_type='gpu', dtype=jnp.float16). "
    "To see the dtypes: jamp.explain(fn, device_type='gpu')(*args); the default dtype of a "
    "device: jamp.get_policy('gpu').compute_dtype"
)
_AUTOCAST = "jamp.autocast(fn, device_type='gpu', dtype=jnp.float16) or @jamp.autocast(device_type='gpu')"

# name looked up on the jamp module -> what to write instead
MODULE_NAMES: dict[str, str] = {
    "GradScaler": f"jamp has no GradScaler class; {_SCALER}",
    "ShardedGradScaler": (
        f"jamp has no ShardedGradScaler; {_SCALER}. Under jax.jit with sharded arrays the "
        "check covers the global gradients; under pmap/shard_map pass "
        "jamp.scaler(optimizer, axis_name=...)"
    ),
    "custom_bwd": (
        "not needed: the backward rule of a jax.custom_vjp runs under the same autocast state as its "
        "forward; decorate the custom_vjp function with jamp.custom_fwd(fn, cast_inputs=jnp.float32) "
        "to run both in one precision"
    ),
    "amp": f"jamp is torch.amp: torch.amp.autocast is {_AUTOCAST}, torch.amp.GradScaler is jamp.scaler(optimizer)",
    "autocast_mode": f"torch.amp.autocast_mode.autocast is {_AUTOCAST}",
    "grad_scaler": "torch.amp.grad_scaler.GradScaler is jamp.scaler(optimizer)",
    "cuda": f"jamp has no per-device modules: torch.cuda.amp.autocast is {_AUTOCAST}, "
    "torch.cuda.amp.GradScaler is jamp.scaler(optimizer)",
    "cpu": "jamp has no per-device modules: torch.cpu.amp.autocast is jamp.autocast(fn, device_type='cpu') "
    "(bfloat16 by default)",
    "is_autocast_available": (
        "every device_type ('gpu'/'cuda', 'cpu', 'tpu') is available: a policy picks op "
        "lists and never checks which hardware is present"
    ),
    **dict.fromkeys(
        (
            "is_autocast_enabled",
            "set_autocast_enabled",
            "get_autocast_dtype",
            "set_autocast_dtype",
            "get_autocast_gpu_dtype",
            "set_autocast_gpu_dtype",
            "get_autocast_cpu_dtype",
            "set_autocast_cpu_dtype",
            "is_autocast_cpu_enabled",
            "set_autocast_cpu_enabled",
            "is_autocast_cache_enabled",
            "set_autocast_cache_enabled",
            "clear_autocast_cache",
        ),
        _NO_GLOBAL_STATE,
    ),
    # jmp and flax
    **dict.fromkeys(
        ("DynamicLossScale", "StaticLossScale", "DynamicScale"),
        f"jamp's dynamic loss scaling is jamp.scaler(optimizer); {_SCALER}",
    ),
    **dict.fromkeys(
        ("all_finite", "select_tree"),
        "not needed: tx = jamp.scaler(optimizer) checks the gradients and skips the step in tx.update",
    ),
}


def missing_attribute(name: str) -> AttributeError:
    """The error for ``jamp.<name>``: what to write instead for a torch.amp name, Python's own message otherwise
    (``name`` and ``obj`` set, so Python still suggests a close spelling)."""
    module = sys.modules["jamp"]
    hint = MODULE_NAMES.get(name)
    message = f"jamp.{name}: {hint}" if hint else f"module 'jamp' has no attribute {name!r}"
    return AttributeError(message, name=name, obj=module)


_TORCH_DTYPES = {"torch.float16": "float16", "torch.half": "float16", "torch.bfloat16": "bfloat16"}


def _dtype_name(value: Any) -> str | None:
    """'float16' for a floating dtype object (``jnp.float16``, ``np.dtype('float16')``, ``torch.float16``)."""
    if isinstance(value, str) or (callable(value) and not isinstance(value, type)):
        return None  # a function (or a module: its str may print every parameter) is never a dtype
    if str(value) in _TORCH_DTYPES:
        return _TORCH_DTYPES[str(value)]
    if not isinstance(value, np.dtype) and not (isinstance(value, type) and hasattr(value, "dtype")):
        return None  # Python's float is a type too, without a dtype
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):  # a class with a ``dtype`` attribute of its own (a flax module's field)
        return None
    return dtype.name if jnp.issubdtype(dtype, jnp.floating) else None  # bfloat16 included


def _keyword_value(name: str, value: Any) -> str:
    """An autocast keyword as the user would write it: dtypes as ``jnp.float16`` (torch's included)."""
    if name != "dtype":
        return repr(value)
    spelled = _TORCH_DTYPES.get(str(value), DTYPE_NAMES.get(value, value) if isinstance(value, str) else value)
    try:
        return f"jnp.{np.dtype(spelled).name}"
    except TypeError:
        return repr(value)


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


# what a positional argument of torch.autocast(device_type, dtype, enabled, cache_enabled) is, by its value
_POSITIONAL_KEYWORD = (
    (lambda v: isinstance(v, str) and v in oplists.DEVICE_ALIASES, "device_type"),
    (lambda v: (isinstance(v, str) and v in DTYPE_NAMES) or _dtype_name(v) is not None, "dtype"),
    (lambda v: isinstance(v, bool), "enabled"),
)


def _keyword_of(value: Any, taken: set[str]) -> str | None:
    keyword = next((k for test, k in _POSITIONAL_KEYWORD if test(value)), None)
    return "cache_enabled" if keyword == "enabled" and keyword in taken else keyword


def _shown_positional(value: Any) -> str:
    if _dtype_name(value) is not None:
        return _keyword_value("dtype", value)
    return getattr(value, "__name__", "fn") if callable(value) else repr(value)


def autocast_positional(args: tuple, options: dict[str, Any], defaults: dict[str, Any]) -> TypeError:
    """The error for ``jamp.autocast(*args, **options)`` whose positional arguments are not one function. torch's
    positional ``device_type``/``dtype``/``enabled`` (``torch.autocast("cuda", torch.float16)``,
    ``jamp.autocast(loss_fn, jnp.float16)``, ``@jamp.autocast(jnp.bfloat16)``) are recognised by their values:
    the message shows the call with them as keywords, beside the keywords given that differ from ``defaults``."""
    fun, *rest = args
    named = callable(fun) and _dtype_name(fun) is None
    positional = rest if named else list(args)
    keywords: list[str | None] = []
    for value in positional:
        keywords.append(_keyword_of(value, {k for k in keywords if k}))
    if None in keywords or len(set(keywords)) < len(keywords):
        if not named and len(args) == 1:
            return TypeError(
                f"autocast()(fun) requires a callable, but got {type(fun).__name__} {fun!r:.60}. "
                "Use jamp.autocast(f)(*args) or @jamp.autocast."
            )
        return TypeError(
            f"jamp.autocast takes one positional argument, the function to transform, and keywords (dtype=, "
            f"device_type=, enabled=, policy=, ...); got {len(args)} positional arguments. Write "
            "jamp.autocast(fn, device_type='gpu', dtype=jnp.float16)(*args)"
        )
    fn = _shown_positional(fun) if named and _shown_positional(fun).isidentifier() else "fn"
    given = dict(zip(keywords, positional))
    given.update({k: v for k, v in options.items() if k not in given and not _is_default(v, defaults[k])})
    written = ", ".join(f"{k}={_keyword_value(k, v)}" for k, v in given.items())
    call = ", ".join(map(_shown_positional, args)) + (", ..." if len(given) > len(positional) else "")
    what = f"{keywords[0]} is a keyword argument" if len(keywords) == 1 else f"{', '.join(keywords)} are keywords"
    return TypeError(
        f"jamp.autocast({call}): {what}; the only positional argument is the function to transform. Write "
        f"jamp.autocast({fn}, {written})(*args), or decorate {fn} with @jamp.autocast({written}): autocast "
        "rewrites a whole function, so what torch runs in a `with torch.autocast(...):` block becomes a function."
    )


def keywords_only(autocast: Callable) -> Callable:
    """``autocast`` (whose only positional parameter is the function) refusing more positional arguments, or a
    dtype in place of the function, with :func:`autocast_positional`'s message instead of Python's."""

    @functools.wraps(autocast)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or (args and _dtype_name(args[0]) is not None):
            parameters = inspect.signature(autocast).parameters.values()
            defaults = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
            raise autocast_positional(args, {**defaults, **kwargs}, defaults)
        return autocast(*args, **kwargs)

    return wrapper


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
    """What :func:`jamp.scaler` returns: an optax transformation whose missing attributes that are GradScaler
    methods (``tx.step``, ``tx.scale``, ``tx.unscale_``) fail with the jamp form."""

    __slots__ = ()

    def __getattr__(self, name: str):
        hint = SCALER_METHODS.get(name)
        message = (
            f"jamp.scaler(...).{name}: torch's scaler.{name} is {hint}"
            if hint
            else f"{type(self).__name__!r} object has no attribute {name!r}"
        )
        raise AttributeError(message, name=name, obj=self)
