"""The function ``jamp.autocast(fn)`` returns: each call's path from arguments to outputs.

A call splits its arguments into traced and static (:mod:`jamp.casting.signature`), lifts the NNX objects among
them (:mod:`jamp.casting.adapters.nnx_nodes`), and looks its signature up in a cache. On a miss it traces the
function to a jaxpr under the policy (:mod:`jamp.casting.tracing`), re-evaluates that jaxpr through the
interpreter (:mod:`jamp.casting.interpreter`), and keeps the rewritten program with its executable. Then it runs
the program (replayed op by op under an outer transformation: :mod:`jamp.casting.replay`) and writes back what
the call wrote to NNX objects.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jamp import _jax_compat as jc
from jamp._arguments import checked_bool, shown
from jamp.casting import oplists, recompute, replay, signature
from jamp.casting.adapters import nnx_nodes
from jamp.casting.call import Context
from jamp.casting.dtypes import checked_reduce_dtype, is_eligible, parse_dtype
from jamp.casting.interpreter import ToolHook, rewrite_jaxpr
from jamp.casting.policy import Mode, Policy, builtin_policy, default_device_type, get_policy
from jamp.casting.regions import Region, marker_for
from jamp.casting.tracing import Tracing, tracing_depth

CACHE_SIZE = 64  # signatures an autocast function keeps traced and compiled, oldest dropped first
# What an autocast function may return: what a jax.jit function may return.
_OUTPUT_SCALARS = (bool, int, float, complex)


class _Entry:
    """One traced signature: the rewritten jaxpr, its output tree, and its executable.

    The executable runs the program as rewritten: a call with arrays is not differentiated, and recompute's
    checkpoints change nothing in a forward pass. Called with tracers (a ``grad``, or a ``jit`` that may be
    differentiated later), the program with its checkpoints (``closed``) runs, regrouped the first time."""

    def __init__(self, rewritten: jc.ClosedJaxpr, out_tree, recompute_on: bool):
        self.rewritten = rewritten
        self.out_tree = out_tree
        self._recompute_on = recompute_on
        self.executable = jax.jit(jc.jaxpr_as_fun(rewritten))

    @functools.cached_property
    def closed(self) -> jc.ClosedJaxpr:
        return recompute.with_recompute(self.rewritten) if self._recompute_on else self.rewritten

    def run(self, dynamic: list) -> list:
        if any(isinstance(x, jax.core.Tracer) for x in dynamic):
            return replay.run(self.closed, dynamic)
        return self.executable(*dynamic)


def _check_device_type(device_type: str | None) -> str | None:
    if device_type is not None and (not isinstance(device_type, str) or device_type not in oplists.DEVICE_ALIASES):
        raise ValueError(
            f"device_type={device_type!r} is not supported; allowed: "
            f"{sorted(oplists.DEVICE_ALIASES)} or None (jax.default_backend())"
        )
    return device_type


def checked_options(dtype, device_type, enabled, cache_enabled, policy, recompute=True) -> tuple:
    """Validated (dtype, device_type, enabled, cache_enabled, policy, recompute) of an autocast."""
    if policy is not None and not isinstance(policy, (Policy, str)):
        raise TypeError(f"policy must be a jamp.Policy or a policy string, got {type(policy).__name__}")
    if isinstance(policy, str):  # validate now; resolving the device waits for the first call
        get_policy(policy, device_type=device_type or "gpu")
    return (
        None if dtype is None else parse_dtype(dtype, "dtype"),
        _check_device_type(device_type),
        checked_bool("enabled", enabled),
        checked_bool("cache_enabled", cache_enabled),
        policy,
        checked_bool("recompute", recompute),
    )


def _resolve_policy(policy_arg: Policy | str | None, device_type: str | None, dtype: Any) -> Policy:
    """The policy of an autocast. ``device_type=None`` asks JAX for the backend, which must not happen at
    import time (it would initialise devices before ``jax.distributed``): call this at the first use."""
    if policy_arg is not None:
        policy = get_policy(policy_arg, device_type=device_type)
    else:
        policy = builtin_policy(device_type or default_device_type())
    return policy if dtype is None else policy.with_compute_dtype(dtype)


def region_of(enabled: bool, dtype: Any, device_type: str | None, policy_arg: Policy | str | None) -> Region:
    """What a nested autocast (a call or a ``with`` block) asks of the enclosing one."""
    if not enabled:
        return Region(Mode.OFF)
    if policy_arg is None and device_type is None:
        return Region(Mode.AUTOCAST, None, dtype)
    return Region(Mode.AUTOCAST, _resolve_policy(policy_arg, device_type, dtype))


class Autocast:
    """The function returned by :func:`jamp.autocast`: ``fun`` rewritten under a policy, cached per signature.

    Inside another autocast's trace it is a region of that trace (a nested ``autocast(g, enabled=False)`` or
    ``dtype=``), outside it the entry point described in the module docstring.
    """

    def __init__(
        self,
        fun: Callable,
        *,
        dtype,
        device_type,
        enabled,
        cache_enabled,
        policy,
        static_argnums,
        static_argnames,
        recompute=True,
        reduce_dtype=None,
    ):
        self.fun = fun
        options = checked_options(dtype, device_type, enabled, cache_enabled, policy, recompute)
        self._dtype, self._device_type, self.enabled, self.cache_enabled, self._policy_arg, self.recompute = options
        # checked against the compute dtype now when it is given, else when the policy is resolved
        self._reduce_dtype = None if reduce_dtype is None else checked_reduce_dtype(reduce_dtype, self._dtype)
        self.static_argnums = signature.static_argnums(static_argnums)
        self.static_argnames = signature.static_argnames(static_argnames)
        self._names = signature.ArgumentNames(fun)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()  # threads share the cache: a lookup must not see another's eviction
        self._traces = signature.Retraces(self._names, CACHE_SIZE)
        functools.update_wrapper(self, fun, updated=())

    @functools.cached_property
    def policy(self) -> Policy:
        """Resolved on first use (see :func:`_resolve_policy`)."""
        policy = _resolve_policy(self._policy_arg, self._device_type, self._dtype)
        return policy if self._reduce_dtype is None else policy.with_reduce_dtype(self._reduce_dtype)

    def __call__(self, *args, **kwargs):
        if tracing_depth():
            region = region_of(self.enabled, self._dtype, self._device_type, self._policy_arg)
            with jax.named_scope(marker_for(region)):
                return self.fun(*args, **kwargs)
        if not self.enabled:
            return self.fun(*args, **kwargs)
        return self._call(args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple:
        """(cache key, dynamic leaves, signature, the NNX graph nodes lifted out of the arguments) of a call."""
        args, kwargs, nodes = nnx_nodes.lift(args, kwargs)
        key, dynamic, sig = signature.split(args, kwargs, self.static_argnums, self.static_argnames)
        return key, dynamic, sig, nodes

    def _call(self, args: tuple, kwargs: dict):
        key, dynamic, sig, nodes = self._prepare(args, kwargs)
        try:
            with self._cache_lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
        except TypeError:  # an unhashable static argument: trace every call
            key, entry = None, None
        if entry is None:
            self._traces.count(sig, dynamic)
            entry = self._trace(sig)  # outside the lock: tracing may call other autocast functions
            if key is not None:
                with self._cache_lock:
                    self._cache[key] = entry
                    if len(self._cache) > CACHE_SIZE:
                        self._cache.popitem(last=False)
        out, writes = jax.tree.unflatten(entry.out_tree, entry.run(dynamic))
        nnx_nodes.write_back(nodes, writes)
        return out

    # -- what the precision tools ask ----------------------------------------------------------------
    def rewrite(self, *args, hook: ToolHook | None = None, **kwargs) -> tuple[jc.ClosedJaxpr, Any]:
        """The rewritten program for these arguments and its output tree; ``hook`` (a precision tool's, see
        :mod:`jamp.tools.observation`) evaluates every equation of a fresh, uncached rewrite."""
        _, _, sig, _ = self._prepare(args, kwargs)
        entry = self._trace(sig, hook=hook)
        return entry.closed, entry.out_tree

    def call_key(self, *args, **kwargs) -> tuple[Any, list]:
        """(cache key, dynamic leaves) of a call as autocast's own cache sees it, for tools that cache
        their own programs per signature; the key is None when a static argument is unhashable."""
        key, dynamic, _, _ = self._prepare(args, kwargs)
        return (key if signature.hashable(key) else None), dynamic

    def trace_original(self, *args, **kwargs) -> tuple[jc.ClosedJaxpr, list, Context]:
        """The function's own jaxpr, its dynamic arguments and the top-level context."""
        _, dynamic, sig, _ = self._prepare(args, kwargs)
        closed, _ = self._original(sig)
        return closed, dynamic, Context(self.policy, Mode.AUTOCAST, (), self.cache_enabled)

    # -- tracing ------------------------------------------------------------------------------------------
    def _original(self, sig: signature.Signature) -> tuple[jc.ClosedJaxpr, Any]:
        out_tree = []

        def flat_fun(*dynamic):
            args, kwargs = sig.arguments(dynamic)
            try:
                out = nnx_nodes.call(self._invoke, args, kwargs)
            except jax.errors.ConcretizationTypeError as error:
                error.add_note(self._names.traced_note(error, sig, dynamic))
                raise
            out_leaves, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return out_leaves

        with Tracing(self.policy):
            closed = jax.make_jaxpr(flat_fun)(*sig.avals)
        return closed, out_tree[0]

    def _invoke(self, args: Sequence, kwargs: dict) -> Any:
        """Call the function being traced and return what the traced program outputs."""
        return self._checked_outputs(self.fun(*args, **kwargs))

    def _checked_outputs(self, out: Any) -> Any:
        """``out``, if every leaf is a value jax.jit could return; else a TypeError that names the leaf."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not (signature.is_dynamic(leaf) or isinstance(leaf, _OUTPUT_SCALARS)):
                where = f"output{jax.tree_util.keystr(path)}" if path else "its output"
                raise TypeError(
                    f"jamp.autocast: {signature.name_of(self.fun)} returned {type(leaf).__name__} {shown(leaf)} as "
                    f"{where}; an autocast function returns what a jax.jit function can: a pytree of arrays and "
                    "Python numbers (None is an empty subtree). Return other values from a function around it."
                )
        return out

    def _trace(self, sig: signature.Signature, hook: ToolHook | None = None) -> _Entry:
        closed, out_tree = self._original(sig)
        policy = self.policy
        n_own = out_tree.children()[0].num_leaves  # the function's own outputs, before the NNX writes
        out_dtypes = tuple(
            policy.output_dtype if i < n_own and policy.output_dtype is not None and is_eligible(a.dtype) else a.dtype
            for i, a in enumerate(closed.out_avals)
        )
        ctx = Context(policy, Mode.AUTOCAST, (), self.cache_enabled, recompute=self.recompute)
        # a tool sees the program as rewritten, without recompute's checkpoints
        rewritten = rewrite_jaxpr(closed, tuple(closed.in_avals), ctx, out_dtypes, hook)
        return _Entry(rewritten, out_tree, self.recompute and hook is None)
