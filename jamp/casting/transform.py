"""``jamp.autocast``: trace to a jaxpr, re-evaluate it under a Policy, cache the result."""

from __future__ import annotations

import collections
import functools
import numbers
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import oplists
from jamp.casting.call import Context
from jamp.casting.dtypes import ELIGIBLE_DTYPES, is_eligible, parse_dtype
from jamp.casting.interpreter import trace_jaxpr
from jamp.casting.policy import (
    AUTOCAST,
    OFF,
    Policy,
    builtin_policy,
    default_device_type,
    get_policy,
)
from jamp.casting.regions import Region, marker_for

_CACHE_SIZE = 64
_state = threading.local()


def _tracing_depth() -> int:
    return getattr(_state, "depth", 0)


class _Tracing:
    """Marks that an autocast is tracing its function: nested autocasts then become regions."""

    def __enter__(self):
        _state.depth = _tracing_depth() + 1

    def __exit__(self, *exc):
        _state.depth -= 1


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _check_device_type(device_type: str | None) -> str | None:
    if device_type is not None and (not isinstance(device_type, str) or device_type not in oplists.DEVICE_ALIASES):
        raise ValueError(f"device_type={device_type!r} is not supported; allowed: "
                         f"{sorted(oplists.DEVICE_ALIASES)} or None (jax.default_backend())")
    return device_type


def _static_argnums(static_argnums: Any) -> tuple[int, ...]:
    """An int or a collection of ints (negative ones count from the end of each call's arguments)."""
    nums = (static_argnums,) if isinstance(static_argnums, numbers.Integral) else static_argnums
    if isinstance(nums, Iterable) and not isinstance(nums, str):
        nums = tuple(nums)
        if all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in nums):
            return tuple(sorted({int(i) for i in nums}))
    raise TypeError(f"static_argnums must be an int or a sequence of ints, got {static_argnums!r}")


def _static_argnames(static_argnames: Any) -> tuple[str, ...]:
    """A str or a collection of strs."""
    names = (static_argnames,) if isinstance(static_argnames, str) else static_argnames
    if isinstance(names, Iterable):
        names = tuple(names)
        if all(isinstance(n, str) for n in names):
            return tuple(set(names))
    raise TypeError(f"static_argnames must be a str or a sequence of strs, got {static_argnames!r}")


class _Entry:
    """One traced signature: the rewritten jaxpr, its output tree, and its executable."""

    def __init__(self, closed: jc.ClosedJaxpr, out_tree):
        self.closed = closed
        self.out_tree = out_tree
        self.executable = jax.jit(jc.jaxpr_as_fun(closed))

    def run(self, dynamic: list) -> list:
        if any(isinstance(x, jax.core.Tracer) for x in dynamic):
            return jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, *dynamic)
        return self.executable(*dynamic)


class Autocast:
    """The function returned by :func:`autocast`."""

    def __init__(self, fun: Callable, *, dtype, device_type, enabled, cache_enabled, policy,
                 static_argnums, static_argnames):
        self.fun = fun
        self.enabled = bool(enabled)
        self.cache_enabled = bool(cache_enabled)
        self._dtype = None if dtype is None else parse_dtype(dtype, "dtype")
        self._device_type = _check_device_type(device_type)
        if policy is not None and not isinstance(policy, (Policy, str)):
            raise TypeError(f"policy must be a jamp.Policy or a policy string, got {type(policy).__name__}")
        if isinstance(policy, str):  # validate now; resolving the device waits for the first call
            get_policy(policy, device_type=device_type or "gpu")
        self._policy_arg = policy
        self.static_argnums = _static_argnums(static_argnums)
        self.static_argnames = _static_argnames(static_argnames)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()  # threads share the cache: a lookup must not see another's eviction
        functools.update_wrapper(self, fun, updated=())

    @functools.cached_property
    def policy(self) -> Policy:
        """Resolved on first use: ``device_type=None`` asks JAX for the backend, which must not
        happen at import time (it would initialise devices before ``jax.distributed``)."""
        if self._policy_arg is not None:
            policy = get_policy(self._policy_arg, device_type=self._device_type)
        else:
            policy = builtin_policy(self._device_type or default_device_type())
        return policy if self._dtype is None else policy.with_compute_dtype(self._dtype)

    def _region(self) -> Region:
        if not self.enabled:
            return Region(OFF)
        if self._policy_arg is None and self._device_type is None:
            return Region(AUTOCAST, None, self._dtype)
        return Region(AUTOCAST, self.policy)

    def __call__(self, *args, **kwargs):
        if _tracing_depth():
            with jax.named_scope(marker_for(self._region())):
                return self.fun(*args, **kwargs)
        if not self.enabled:
            return self.fun(*args, **kwargs)
        return self._call(args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict):
        """(cache key, dynamic leaves, signature for ``_original``/``_trace``) of one call."""
        # as jax.jit: a negative index counts from the end of this call's positional arguments
        argnums = sorted({i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)})
        static_args = tuple((i, args[i]) for i in argnums)
        static_kwargs = tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
        rest_args = tuple(a for i, a in enumerate(args) if i not in argnums)
        rest_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree.flatten((rest_args, rest_kwargs))
        dynamic_mask = tuple(_is_dynamic(x) for x in leaves)
        dynamic = [x for x, d in zip(leaves, dynamic_mask) if d]
        static_leaves = tuple(x for x, d in zip(leaves, dynamic_mask) if not d)
        avals = tuple(jax.typeof(x) for x in dynamic)
        key = (treedef, dynamic_mask, static_leaves, static_args, static_kwargs, avals)
        signature = (avals, treedef, dynamic_mask, static_leaves, dict(static_args), dict(static_kwargs))
        return key, dynamic, signature

    def _call(self, args: tuple, kwargs: dict):
        key, dynamic, signature = self._prepare(args, kwargs)
        try:
            with self._cache_lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
        except TypeError:  # an unhashable static argument: trace every call
            key, entry = None, None
        if entry is None:
            entry = self._trace(*signature)  # outside the lock: tracing may call other autocast functions
            if key is not None:
                with self._cache_lock:
                    self._cache[key] = entry
                    if len(self._cache) > _CACHE_SIZE:
                        self._cache.popitem(last=False)
        return jax.tree.unflatten(entry.out_tree, entry.run(dynamic))

    def rewrite(self, *args, recorder: Any = None, **kwargs) -> tuple[jc.ClosedJaxpr, Any]:
        """The rewritten program for these arguments and its output tree; ``recorder`` (see
        :mod:`jamp.tools.explanation`) sees every decision of a fresh, uncached rewrite."""
        _, _, signature = self._prepare(args, kwargs)
        entry = self._trace(*signature, recorder=recorder)
        return entry.closed, entry.out_tree

    def trace_original(self, *args, **kwargs) -> tuple[jc.ClosedJaxpr, list, Context]:
        """The function's own jaxpr, its dynamic arguments and the top-level context."""
        _, dynamic, signature = self._prepare(args, kwargs)
        closed, _ = self._original(*signature)
        return closed, dynamic, Context(self.policy, AUTOCAST, (), self.cache_enabled)

    def _original(self, avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs):
        out_tree = []

        def flat_fun(*dynamic):
            dyn, stat = iter(dynamic), iter(static_leaves)
            leaves = [next(dyn) if d else next(stat) for d in dynamic_mask]
            rest_args, kwargs = jax.tree.unflatten(treedef, leaves)
            rest = iter(rest_args)
            n = len(rest_args) + len(static_args)
            args = [static_args[i] if i in static_args else next(rest) for i in range(n)]
            out_leaves, tree = jax.tree.flatten(self.fun(*args, **kwargs, **static_kwargs))
            out_tree.append(tree)
            return out_leaves

        with _Tracing():
            closed = jax.make_jaxpr(flat_fun)(*avals)
        return closed, out_tree[0]

    def _trace(self, avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs,
               recorder: Any = None) -> _Entry:
        closed, out_tree = self._original(avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs)
        policy = self.policy
        out_dtypes = tuple(policy.output_dtype if policy.output_dtype is not None and is_eligible(a.dtype)
                           else a.dtype for a in closed.out_avals)
        ctx = Context(policy, AUTOCAST, (), self.cache_enabled, recorder)
        return _Entry(trace_jaxpr(closed, tuple(closed.in_avals), ctx, out_dtypes), out_tree)


def autocast(fun: Callable | None = None, /, *, dtype: Any = None, device_type: str | None = None,
             enabled: bool = True, cache_enabled: bool = True, policy: Policy | str | None = None,
             static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = ()):
    """Run ``fun`` with automatic mixed precision (torch's ``autocast``, as a function transformation).

    Matmuls and convolutions run in ``dtype`` (float16 on ``device_type="gpu"``, bfloat16 on
    ``"cpu"``/``"tpu"``), numerically sensitive ops in float32, multi-input ops at their widest
    input; the op lists are ``policy`` (see :mod:`jamp.casting.oplists`). Use as ``autocast(f)``,
    ``@autocast`` or ``@autocast(dtype=jnp.bfloat16)``. Inside another autocast function,
    ``autocast(g, enabled=False)`` runs ``g`` as written and ``autocast(g, dtype=...)`` switches the
    dtype for ``g``. Outputs keep the dtypes ``fun`` declares (or the policy's output dtype).
    Non-array arguments (Python numbers, strings, ...) are static; ``static_argnums`` and
    ``static_argnames`` make array-valued ones static too.
    """
    if fun is None:
        return functools.partial(autocast, dtype=dtype, device_type=device_type, enabled=enabled,
                                 cache_enabled=cache_enabled, policy=policy, static_argnums=static_argnums,
                                 static_argnames=static_argnames)
    if not callable(fun):
        raise TypeError(f"autocast()(fun) requires a callable, but got {type(fun).__name__}. "
                        "Use jamp.autocast(f)(*args) or @jamp.autocast.")
    return Autocast(fun, dtype=dtype, device_type=device_type, enabled=enabled, cache_enabled=cache_enabled,
                    policy=policy, static_argnums=static_argnums, static_argnames=static_argnames)


def custom_fwd(fun: Callable | None = None, /, *, cast_inputs: Any = None):
    """torch's ``custom_fwd(cast_inputs=...)``: inside an autocast function, cast ``fun``'s floating
    inputs to ``cast_inputs`` and run it with autocast off. Outside autocast, or with
    ``cast_inputs=None``, ``fun`` runs unchanged. Decorate a ``jax.custom_vjp`` function with it to
    keep a hand-written kernel and its backward rule in one precision; the backward rule of a
    custom_vjp always runs under the same autocast state as its forward (torch's ``custom_bwd``)."""
    if fun is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    if not callable(fun):
        raise TypeError(f"custom_fwd requires a callable, but got {type(fun).__name__}")
    dtype = None if cast_inputs is None else parse_dtype(cast_inputs, "cast_inputs", ELIGIBLE_DTYPES)

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if dtype is None or not _tracing_depth():
            return fun(*args, **kwargs)
        cast = lambda x: x.astype(dtype) if _is_dynamic(x) and is_eligible(jnp.result_type(x)) else x  # noqa: E731
        args, kwargs = jax.tree.map(cast, (args, kwargs))
        with jax.named_scope(marker_for(Region(OFF))):
            return fun(*args, **kwargs)

    return wrapper
