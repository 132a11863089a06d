"""``jamp.custom_fwd``: torch's ``custom_fwd(cast_inputs=...)``, a function that runs in one precision."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jamp.casting.dtypes import ELIGIBLE_DTYPES, is_eligible, parse_dtype
from jamp.casting.policy import Mode
from jamp.casting.regions import Region, marker_for
from jamp.casting.signature import is_dynamic
from jamp.casting.tracing import tracing_depth


def custom_fwd(fun: Callable | None = None, /, *, cast_inputs: Any = None) -> Callable:
    """torch's ``custom_fwd(cast_inputs=...)``: a function that runs in one precision inside autocast.

    Inside an autocast function, cast ``fun``'s floating inputs to ``cast_inputs`` and run it with autocast
    off. Outside autocast, or with ``cast_inputs=None``, ``fun`` runs unchanged. Decorate a ``jax.custom_vjp``
    function with it to keep a hand-written kernel and its backward rule in one precision; the backward rule of
    a custom_vjp always runs under the same autocast state as its forward (torch's ``custom_bwd``).

    Args:
        fun: the function; omit it to get a decorator.
        cast_inputs: the dtype its floating array inputs are cast to (``jnp.float32``, ``jnp.float16``,
            ``jnp.bfloat16``), or None to only turn autocast off inside it.

    Returns:
        The wrapped function (or a decorator when ``fun`` is omitted).

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> @jamp.custom_fwd(cast_inputs=jnp.float32)
        ... def kernel(x):
        ...     return x * x
        >>> jamp.autocast(kernel, device_type="gpu")(jnp.ones(3, jnp.float16)).dtype
        dtype('float32')
    """
    if fun is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    if not callable(fun):
        raise TypeError(f"custom_fwd requires a callable, but got {type(fun).__name__}")
    dtype = None if cast_inputs is None else parse_dtype(cast_inputs, "cast_inputs", ELIGIBLE_DTYPES)

    def cast(x: Any) -> Any:
        return x.astype(dtype) if is_dynamic(x) and is_eligible(jnp.result_type(x)) else x

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if dtype is None or not tracing_depth():
            return fun(*args, **kwargs)
        args, kwargs = jax.tree.map(cast, (args, kwargs))
        with jax.named_scope(marker_for(Region(Mode.OFF))):
            return fun(*args, **kwargs)

    return wrapper
