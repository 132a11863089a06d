"""torch's ``autocast(device_type, dtype, ...)`` habits, answered with the jamp call.

``jamp.autocast("cuda", dtype=torch.float16)`` or ``jamp.autocast(loss_fn, jnp.float16)`` is a habit, not a typo:
torch takes ``device_type`` and ``dtype`` positionally, jamp only the function. The positional values are
recognised by what they are, and the error shows the call with them as keywords.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jamp.casting import oplists
from jamp.casting.dtypes import DTYPE_NAMES

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
