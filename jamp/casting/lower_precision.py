"""``jamp.lower_precision``: a call that autocast traces in the region's compute dtype.

Autocast traces the user's function with the values it is given (a float32 model: float32) and casts
afterwards, equation by equation. A kernel that checks its input dtypes while it is traced
(``jax.nn.dot_product_attention(implementation="cudnn")``: "Q must be fp16/bf16") refuses that trace,
and one that accepts float32 (a Pallas kernel) stays an opaque float32 call. A function wrapped with
``lower_precision`` is a ``lower`` op of its own instead: while an autocast traces, the call is
recorded as a ``jax.jit`` whose body casts the floating inputs to the compute dtype of the region it is
in, calls the function, and casts the outputs in that dtype back to the inputs' dtype (the dtypes the
surrounding float32 code was written for). The interpreter recognises the recorded body and traces the
function again with the dtypes its context decides (:mod:`jamp.casting.rules.lower_precision`). Outside
autocast the wrapper is the function.

Arrays (and tracers) are the call's inputs; every other argument (Python numbers, strings, None,
functions) is static, as under ``eqx.filter_jit``: a kernel's ``scale=0.125`` or block size stays a
Python value.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import oplists
from jamp.casting.call import cast
from jamp.casting.dtypes import FLOAT32, is_eligible, is_low
from jamp.casting.policy import Mode
from jamp.casting.regions import EFFECTIVE_RULE, LeafRule
from jamp.casting.tracing import traced_region, tracing_depth

jc.hide_from_source_info(__file__)  # a recorded call points to the line that made it


def _compute_dtype(dtype, recorded, compute):
    return compute if is_eligible(dtype) else dtype


# The rule a `lower` op gets in a region mode (regions.EFFECTIVE_RULE) -> the dtype a floating input of a
# lower-precision call is traced with, from (the dtype that arrives, the recorded dtype, the compute dtype).
INPUT_DTYPE = {
    LeafRule.LOWER: _compute_dtype,
    LeafRule.LOWER_FLOAT32_OUTPUT: _compute_dtype,
    LeafRule.FLOAT32: lambda dtype, recorded, compute: FLOAT32 if is_low(dtype) else dtype,
    LeafRule.PROMOTE: lambda dtype, recorded, compute: dtype,  # the `native` mode: no casts of its own
    LeafRule.DEFAULT: lambda dtype, recorded, compute: recorded,  # `off`: the function as written
}


def input_dtypes(mode: Mode, compute_dtype, dtypes: Sequence, recorded: Sequence) -> tuple:
    """The dtype each input of a lower-precision call is traced with in region ``mode``."""
    choose = INPUT_DTYPE[EFFECTIVE_RULE[mode][oplists.Category.LOWER]]
    return tuple(
        np.dtype(choose(d, r, compute_dtype)) if jnp.issubdtype(d, jnp.floating) else d
        for d, r in zip(dtypes, recorded)
    )


def _is_input(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


@dataclasses.dataclass(frozen=True, eq=False)
class LowPrecisionCall:
    """One call site's function and arguments, without the array values: what tracing it again needs."""

    fn: Callable
    in_tree: Any
    input_mask: tuple[bool, ...]
    static_leaves: tuple

    @property
    def name(self) -> str:
        """The recorded jit's name: the function's (region rules may name it), as a path component."""
        name = getattr(self.fn, "__name__", None) or type(self.fn).__name__
        return re.sub(r"\W", "_", name)

    def arguments(self, inputs: Sequence) -> tuple[tuple, dict]:
        """(args, kwargs) of the call with these input values."""
        inputs, static = iter(inputs), iter(self.static_leaves)
        return jax.tree.unflatten(self.in_tree, [next(inputs) if d else next(static) for d in self.input_mask])

    def flat_call(self, *inputs) -> list:
        args, kwargs = self.arguments(inputs)
        return jax.tree.leaves(self.fn(*args, **kwargs))


# Recorded body (ClosedJaxpr, compared by identity) -> its call. The jaxpr being interpreted holds the body,
# so an entry lives as long as some program can still meet it; a body JAX transformed (vmap, grad inside
# the autocast function) is another jaxpr and falls back to being evaluated as recorded.
_RECORDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_recorded_lock = threading.Lock()


def recorded_call(body: Any) -> LowPrecisionCall | None:
    """The call whose recorded body ``body`` is, if it is one."""
    with _recorded_lock:
        return _RECORDED.get(body)


class _Recording:
    """The jitted body of one call site for one set of input types (cached, so that JAX's trace cache hits
    when a model calls the same function on the same types again, e.g. once per layer)."""

    def __init__(self, call: LowPrecisionCall, in_avals: tuple, traced_dtypes: tuple):
        self.call = call
        self.out_tree: Any = None
        in_dtypes = [a.dtype for a in in_avals]
        cast_inputs = [d != t for d, t in zip(in_dtypes, traced_dtypes)]
        # outputs in the dtype the inputs were cast to go back to the dtype those inputs had
        declared = jnp.result_type(*[d for d, c in zip(in_dtypes, cast_inputs) if c]) if any(cast_inputs) else None
        cast_to = {t for t, c in zip(traced_dtypes, cast_inputs) if c}

        def body(*inputs):
            args, kwargs = call.arguments([cast(x, t) for x, t in zip(inputs, traced_dtypes)])
            out_leaves, self.out_tree = jax.tree.flatten(call.fn(*args, **kwargs))
            return [cast(o, declared) if getattr(o, "dtype", None) in cast_to else o for o in out_leaves]

        body.__name__ = body.__qualname__ = call.name
        self.jitted = jax.jit(body)

    def __call__(self, inputs: list) -> Any:
        body = jc.jit_body(self.jitted, *inputs)
        with _recorded_lock:
            _RECORDED[body] = self.call
        return jax.tree.unflatten(self.out_tree, self.jitted(*inputs))


@functools.lru_cache(maxsize=1024)
def _cached_recording(key: tuple, in_avals: tuple, traced_dtypes: tuple) -> _Recording:
    return _Recording(LowPrecisionCall(*key), in_avals, traced_dtypes)


def _record(fn: Callable, args: tuple, kwargs: dict) -> Any:
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    mask = tuple(_is_input(x) for x in leaves)
    inputs = [x for x, d in zip(leaves, mask) if d]
    key = (fn, in_tree, mask, tuple(x for x, d in zip(leaves, mask) if not d))
    policy, mode = traced_region()
    in_avals = tuple(jax.typeof(x) for x in inputs)
    in_dtypes = [a.dtype for a in in_avals]
    traced = input_dtypes(mode, policy.compute_dtype, in_dtypes, in_dtypes)
    try:
        recording = _cached_recording(key, in_avals, traced)
    except TypeError:  # an unhashable static argument: record this call on its own
        recording = _Recording(LowPrecisionCall(*key), in_avals, traced)
    return recording(inputs)


def lower_precision(fn: Callable) -> Callable:
    """Run ``fn`` in the autocast compute dtype: a call that joins torch's ``lower_precision_fp`` list.

    Inside a function that ``jamp.autocast`` transforms, ``fn`` is traced with its floating array
    inputs (float16, bfloat16, float32) cast to the compute dtype of the region it is called in (the
    autocast's dtype, a nested ``jamp.autocast(dtype=...)``'s, float32 in a ``float32`` region, the
    dtypes as written in an ``enabled=False`` region), so a kernel that refuses float32 while it is traced
    (cuDNN attention, a Pallas kernel written for bfloat16, an fp8 GEMM) gets low-precision inputs from a
    float32 model. Its outputs stay in that dtype, as a matmul's do, and the surrounding code follows the
    policy. Non-array arguments are static. Outside autocast, the wrapper calls ``fn`` unchanged.

    Args:
        fn: the function (a kernel); its array arguments, anywhere in its pytree arguments, are its inputs,
            and every other argument (Python numbers, strings, None, functions) is static.

    Returns:
        The wrapped function, with ``fn``'s signature; use it as a decorator.

    Raises:
        TypeError: when ``fn`` is not callable.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> @jamp.lower_precision
        ... def half_only(x):  # like cuDNN attention: refuses float32 when traced
        ...     if x.dtype != jnp.float16:
        ...         raise TypeError("float16 only")
        ...     return x * 2
        >>> jamp.autocast(half_only, device_type="gpu")(jnp.ones(3))  # a float32 model
        Array([2., 2., 2.], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"lower_precision requires a callable, but got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not tracing_depth():
            return fn(*args, **kwargs)
        return _record(fn, args, kwargs)

    return wrapper
