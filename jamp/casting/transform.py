"""``jamp.autocast``: trace to a jaxpr, re-evaluate it under a Policy, cache the result."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import numbers
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp import _torch_names as torch_names
from jamp._arguments import checked_bool, shown
from jamp.casting import nnx_nodes, oplists, replay
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
from jamp.casting.tracing import Tracing, tracing_depth

_CACHE_SIZE = 64
# Traces of one array signature after which a static value that keeps changing is reported, once.
_RETRACE_WARNING = 16


def _is_dynamic(x: Any) -> bool:
    """An array (what custom_fwd casts)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


# Python scalars that autocast traces, weak-typed, as jax.jit does. bool and int stay static: they
# size shapes, index, count loops and pick branches; strings, None and other objects are static too.
_TRACED_SCALARS = (float, complex)
# What an autocast function may return: what a jax.jit function may return.
_OUTPUT_SCALARS = (bool, int, float, complex)


def _is_traced(x: Any) -> bool:
    """A leaf of the arguments that becomes an input of the traced program (not part of the cache key)."""
    return _is_dynamic(x) or isinstance(x, _TRACED_SCALARS)


def equinox_module_type() -> type | None:
    """``equinox.Module``, looked up, not imported: a program that holds an Equinox module has imported it."""
    equinox = sys.modules.get("equinox")
    return None if equinox is None else equinox.Module


def _traced_mask(tree: Any) -> tuple[bool, ...]:
    """For each leaf of ``tree``, whether it is traced. Inside an Equinox module only arrays are, as under
    ``eqx.filter_jit``: its other leaves (MaxPool's ``-inf`` init, a dropout rate, activation functions) are
    configuration that its code may use in Python (a traced MaxPool init has no gradient rule)."""
    module_type = equinox_module_type()
    if module_type is None:
        return tuple(_is_traced(x) for x in jax.tree.leaves(tree))
    mask: list[bool] = []
    for sub in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, module_type)):
        if isinstance(sub, module_type):
            mask.extend(_is_dynamic(x) for x in jax.tree.leaves(sub))
        else:
            mask.append(_is_traced(sub))
    return tuple(mask)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _same(a: Any, b: Any) -> bool:
    """Whether two static values hit the same cache entry (an unhashable value never does)."""
    if not (_hashable(a) and _hashable(b)):
        return False
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 (an == that gives no bool)
        return False


def _check_device_type(device_type: str | None) -> str | None:
    if device_type is not None and (not isinstance(device_type, str) or device_type not in oplists.DEVICE_ALIASES):
        raise ValueError(
            f"device_type={device_type!r} is not supported; allowed: "
            f"{sorted(oplists.DEVICE_ALIASES)} or None (jax.default_backend())"
        )
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


def _unflatten(treedef, dynamic_mask: tuple, dynamic: Sequence, static_leaves: tuple) -> tuple:
    """(non-static positional args, keyword args) from the two kinds of leaves."""
    dyn, stat = iter(dynamic), iter(static_leaves)
    return jax.tree.unflatten(treedef, [next(dyn) if d else next(stat) for d in dynamic_mask])


def _name(fun: Any) -> str:
    return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or type(fun).__name__


class _TraceCount:
    """Traces of one array signature: how many, the last static values, how often each changed."""

    def __init__(self, values: tuple):
        self.count, self.values, self.changes = 1, values, collections.Counter()


class _Entry:
    """One traced signature: the rewritten jaxpr, its output tree, and its executable."""

    def __init__(self, closed: jc.ClosedJaxpr, out_tree):
        self.closed = closed
        self.out_tree = out_tree
        self.executable = jax.jit(jc.jaxpr_as_fun(closed))

    def run(self, dynamic: list) -> list:
        if any(isinstance(x, jax.core.Tracer) for x in dynamic):
            return replay.run(self.closed, dynamic)
        return self.executable(*dynamic)


def _checked_options(dtype, device_type, enabled, cache_enabled, policy) -> tuple:
    """Validated (dtype, device_type, enabled, cache_enabled, policy) of an autocast."""
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
    )


def _resolve_policy(policy_arg: Policy | str | None, device_type: str | None, dtype: Any) -> Policy:
    """The policy of an autocast. ``device_type=None`` asks JAX for the backend, which must not happen at
    import time (it would initialise devices before ``jax.distributed``): call this at the first use."""
    if policy_arg is not None:
        policy = get_policy(policy_arg, device_type=device_type)
    else:
        policy = builtin_policy(device_type or default_device_type())
    return policy if dtype is None else policy.with_compute_dtype(dtype)


def _region_of(enabled: bool, dtype: Any, device_type: str | None, policy_arg: Policy | str | None) -> Region:
    """What a nested autocast (a call or a ``with`` block) asks of the enclosing one."""
    if not enabled:
        return Region(OFF)
    if policy_arg is None and device_type is None:
        return Region(AUTOCAST, None, dtype)
    return Region(AUTOCAST, _resolve_policy(policy_arg, device_type, dtype))


class Autocast:
    """The function returned by :func:`autocast`."""

    def __init__(
        self, fun: Callable, *, dtype, device_type, enabled, cache_enabled, policy, static_argnums, static_argnames
    ):
        self.fun = fun
        self._dtype, self._device_type, self.enabled, self.cache_enabled, self._policy_arg = _checked_options(
            dtype, device_type, enabled, cache_enabled, policy
        )
        self.static_argnums = _static_argnums(static_argnums)
        self.static_argnames = _static_argnames(static_argnames)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()  # threads share the cache: a lookup must not see another's eviction
        self._traces: collections.OrderedDict = collections.OrderedDict()  # array signature -> _TraceCount
        self._warned_retrace = False
        functools.update_wrapper(self, fun, updated=())

    @functools.cached_property
    def policy(self) -> Policy:
        """Resolved on first use (see :func:`_resolve_policy`)."""
        return _resolve_policy(self._policy_arg, self._device_type, self._dtype)

    def _region(self) -> Region:
        return _region_of(self.enabled, self._dtype, self._device_type, self._policy_arg)

    def __call__(self, *args, **kwargs):
        if tracing_depth():
            with jax.named_scope(marker_for(self._region())):
                return self.fun(*args, **kwargs)
        if not self.enabled:
            return self.fun(*args, **kwargs)
        return self._call(args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict):
        """(cache key, dynamic leaves, signature for ``_original``/``_trace``, the NNX graph nodes lifted out of
        the arguments) of one call."""
        args, kwargs, nodes = nnx_nodes.lift(args, kwargs)
        # as jax.jit: a negative index counts from the end of this call's positional arguments
        argnums = sorted({i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)})
        static_args = tuple((i, args[i]) for i in argnums)
        static_kwargs = tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
        rest_args = tuple(a for i, a in enumerate(args) if i not in argnums)
        rest_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree.flatten((rest_args, rest_kwargs))
        dynamic_mask = _traced_mask((rest_args, rest_kwargs))
        dynamic = [x for x, d in zip(leaves, dynamic_mask) if d]
        static_leaves = tuple(x for x, d in zip(leaves, dynamic_mask) if not d)
        avals = tuple(jax.typeof(x) for x in dynamic)
        key = (treedef, dynamic_mask, static_leaves, static_args, static_kwargs, avals)
        signature = (avals, treedef, dynamic_mask, static_leaves, dict(static_args), dict(static_kwargs))
        return key, dynamic, signature, nodes

    def _call(self, args: tuple, kwargs: dict):
        key, dynamic, signature, nodes = self._prepare(args, kwargs)
        try:
            with self._cache_lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
        except TypeError:  # an unhashable static argument: trace every call
            key, entry = None, None
        if entry is None:
            self._count_trace(signature, dynamic)
            entry = self._trace(*signature)  # outside the lock: tracing may call other autocast functions
            if key is not None:
                with self._cache_lock:
                    self._cache[key] = entry
                    if len(self._cache) > _CACHE_SIZE:
                        self._cache.popitem(last=False)
        out, writes = jax.tree.unflatten(entry.out_tree, entry.run(dynamic))
        nnx_nodes.write_back(nodes, writes)
        return out

    # -- naming arguments in messages, counting traces ------------------------------------------------
    def _positional_name(self, i: int) -> str:
        try:
            params = list(inspect.signature(self.fun).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            return f"args[{i}]"
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if i < len(positional):
            return positional[i]
        star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
        return f"{star}[{i - len(positional)}]"

    def _leaf_names(self, rest_args: tuple, rest_kwargs: dict, static_args: dict) -> list[str]:
        """The name of every leaf of ``(rest_args, rest_kwargs)``, in flattening order: ``config['lr']``."""
        positions = [i for i in range(len(rest_args) + len(static_args)) if i not in static_args]
        names = []
        for path, _ in jax.tree_util.tree_flatten_with_path((rest_args, rest_kwargs))[0]:
            top = self._positional_name(positions[path[1].idx]) if path[0].idx == 0 else path[1].key
            names.append(top + jax.tree_util.keystr(path[2:]))
        return names

    def _traced_note(self, error: Exception, rest_args: tuple, rest_kwargs: dict, static_args: dict) -> str:
        """JAX names the traced inputs ``dynamic[i]``: say which argument each one is."""
        names = [
            n
            for n, traced in zip(
                self._leaf_names(rest_args, rest_kwargs, static_args), _traced_mask((rest_args, rest_kwargs))
            )
            if traced
        ]
        cited = sorted({int(i) for i in re.findall(r"dynamic\[(\d+)\]", str(error))})
        which = ", ".join(f"dynamic[{i}] is {names[i]}" for i in cited if i < len(names))
        return (
            f"jamp.autocast({_name(self.fun)}): {which + '. ' if which else ''}jamp.autocast traces array "
            "arguments and Python floats, as jax.jit does (bools, ints, strings and other objects are "
            "static). To use a value in Python control flow, make it static with static_argnums or "
            "static_argnames."
        )

    def _count_trace(self, signature: tuple, dynamic: list) -> None:
        """Warn once when one array signature has been traced again and again because a static value
        (a Python int, a string, an unhashable object...) keeps changing: the silent slow path of a cache."""
        avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs = signature
        values = (*static_leaves, *static_args.values(), *static_kwargs.values())
        try:
            key = (avals, treedef, dynamic_mask, tuple(static_args), tuple(static_kwargs))
            count = self._traces.get(key)
        except TypeError:  # an unhashable pytree node: nothing to count by
            return
        if count is None:
            self._traces[key] = _TraceCount(values)
            if len(self._traces) > _CACHE_SIZE:
                self._traces.popitem(last=False)
            return
        self._traces.move_to_end(key)
        count.count += 1
        count.changes.update(i for i, (a, b) in enumerate(zip(values, count.values)) if not _same(a, b))
        count.values = values
        if count.count <= _RETRACE_WARNING or self._warned_retrace or not count.changes:
            return
        self._warned_retrace = True
        rest_args, rest_kwargs = _unflatten(treedef, dynamic_mask, dynamic, static_leaves)
        leaf_names = self._leaf_names(rest_args, rest_kwargs, static_args)
        names = (
            [n for n, d in zip(leaf_names, dynamic_mask) if not d]
            + [self._positional_name(i) for i in static_args]
            + list(static_kwargs)
        )
        i, changed = count.changes.most_common(1)[0]
        if _hashable(values[i]):
            why = (
                f"the argument {names[i]} changed {changed} times (last value {shown(values[i])}). It is static "
                "(part of the cache key): each new value traces and compiles again. Pass it as an array "
                "(jnp.asarray(...)) to trace it once, as jax.jit does"
            )
        else:
            why = (
                f"the argument {names[i]} is not hashable ({shown(values[i])}), so no trace of it is cached. "
                "Pass a hashable value (a tuple) or an array"
            )
        warnings.warn(
            f"jamp.autocast({_name(self.fun)}) has traced the same array shapes and dtypes {count.count} times "
            f"because {why}.",
            UserWarning,
            stacklevel=4,
        )

    def rewrite(self, *args, recorder: Any = None, **kwargs) -> tuple[jc.ClosedJaxpr, Any]:
        """The rewritten program for these arguments and its output tree; ``recorder`` (see
        :mod:`jamp.tools.explanation`) sees every decision of a fresh, uncached rewrite."""
        _, _, signature, _ = self._prepare(args, kwargs)
        entry = self._trace(*signature, recorder=recorder)
        return entry.closed, entry.out_tree

    def call_key(self, *args, **kwargs) -> tuple[Any, list]:
        """(cache key, dynamic leaves) of a call as autocast's own cache sees it, for tools that cache
        their own programs per signature; the key is None when a static argument is unhashable."""
        key, dynamic, _, _ = self._prepare(args, kwargs)
        try:
            hash(key)
        except TypeError:
            key = None
        return key, dynamic

    def trace_original(self, *args, **kwargs) -> tuple[jc.ClosedJaxpr, list, Context]:
        """The function's own jaxpr, its dynamic arguments and the top-level context."""
        _, dynamic, signature, _ = self._prepare(args, kwargs)
        closed, _ = self._original(*signature)
        return closed, dynamic, Context(self.policy, AUTOCAST, (), self.cache_enabled)

    def _original(self, avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs):
        out_tree = []

        def flat_fun(*dynamic):
            rest_args, kwargs = _unflatten(treedef, dynamic_mask, dynamic, static_leaves)
            rest = iter(rest_args)
            n = len(rest_args) + len(static_args)
            args = [static_args[i] if i in static_args else next(rest) for i in range(n)]
            try:
                out = nnx_nodes.call(self._invoke, args, {**kwargs, **static_kwargs})
            except jax.errors.ConcretizationTypeError as error:
                error.add_note(self._traced_note(error, rest_args, kwargs, static_args))
                raise
            out_leaves, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return out_leaves

        with Tracing(self.policy):
            closed = jax.make_jaxpr(flat_fun)(*avals)
        return closed, out_tree[0]

    def _invoke(self, args: list, kwargs: dict) -> Any:
        """Call the function being traced and return what the traced program outputs."""
        return self._checked_outputs(self.fun(*args, **kwargs))

    def _checked_outputs(self, out: Any) -> Any:
        """``out``, if every leaf is a value jax.jit could return; else a TypeError that names the leaf."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not (_is_dynamic(leaf) or isinstance(leaf, _OUTPUT_SCALARS)):
                where = f"output{jax.tree_util.keystr(path)}" if path else "its output"
                raise TypeError(
                    f"jamp.autocast: {_name(self.fun)} returned {type(leaf).__name__} {shown(leaf)} as {where}; "
                    "an autocast function returns what a jax.jit function can: a pytree of arrays and Python "
                    "numbers (None is an empty subtree). Return other values from a function around it."
                )
        return out

    def _trace(
        self, avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs, recorder: Any = None
    ) -> _Entry:
        closed, out_tree = self._original(avals, treedef, dynamic_mask, static_leaves, static_args, static_kwargs)
        policy = self.policy
        n_own = out_tree.children()[0].num_leaves  # the function's own outputs, before the NNX writes
        out_dtypes = tuple(
            policy.output_dtype if i < n_own and policy.output_dtype is not None and is_eligible(a.dtype) else a.dtype
            for i, a in enumerate(closed.out_avals)
        )
        ctx = Context(policy, AUTOCAST, (), self.cache_enabled, recorder)
        return _Entry(trace_jaxpr(closed, tuple(closed.in_avals), ctx, out_dtypes), out_tree)


class AutocastSpec:
    """``jamp.autocast(...)`` without a function: a decorator, and a ``with`` block.

    Inside a function that an autocast is tracing, ``with jamp.autocast(enabled=False):`` (or
    ``dtype=``, ``device_type=``, ``policy=``) marks its lines as a region exactly as the nested call
    ``jamp.autocast(g, enabled=False)(...)`` does: torch's nested ``with autocast(...)``. A rewrite needs
    the whole function, so a ``with`` that would turn autocast on outside any autocast function is an
    error that shows the function form; ``with jamp.autocast(enabled=False):`` there does nothing, as in
    torch (outside autocast every op already runs as written), so model code that uses it also runs
    without autocast.
    """

    def __init__(self, options: dict):
        self._options = options
        self._dtype, self._device_type, self._enabled, _, self._policy_arg = _checked_options(
            options["dtype"], options["device_type"], options["enabled"], options["cache_enabled"], options["policy"]
        )
        self._scopes = threading.local()

    def __call__(self, fun: Callable) -> Autocast:
        return autocast(fun, **self._options)

    def __repr__(self) -> str:
        return f"jamp.autocast({self._given()})"

    def _given(self) -> str:
        """The options that differ from the defaults, as the user would write them."""
        given = {k: v for k, v in self._options.items() if not _same(v, _DEFAULT_OPTIONS[k])}
        if "dtype" in given:
            given["dtype"] = f"jnp.{self._dtype.name}"
        return ", ".join(f"{k}={v if k == 'dtype' else repr(v)}" for k, v in given.items())

    def __enter__(self) -> None:
        if any(not _same(self._options[k], _DEFAULT_OPTIONS[k]) for k in ("static_argnums", "static_argnames")):
            raise TypeError(
                f"static_argnums and static_argnames describe a function's arguments; a `with {self!r}:` block has none"
            )
        if tracing_depth():
            scope = jax.named_scope(
                marker_for(_region_of(self._enabled, self._dtype, self._device_type, self._policy_arg))
            )
        elif not self._enabled:
            scope = contextlib.nullcontext()
        else:
            given = self._given()
            raise RuntimeError(
                f"`with {self!r}:` is used outside any function that jamp.autocast transforms. jamp.autocast "
                "rewrites a whole function (its jaxpr), so it takes the function: write "
                f"`jamp.autocast(fn{', ' + given if given else ''})(*args)` or decorate it with "
                f"`@{self!r}`. Inside such a function, `with jamp.autocast(enabled=False):` and "
                "`with jamp.autocast(dtype=...):` mark regions."
            )
        scope.__enter__()
        self._scopes.__dict__.setdefault("stack", []).append(scope)

    def __exit__(self, *exc: object) -> bool | None:
        return self._scopes.stack.pop().__exit__(*exc)


@torch_names.keywords_only
def autocast(
    fun: Callable | None = None,
    /,
    *,
    dtype: Any = None,
    device_type: str | None = None,
    enabled: bool = True,
    cache_enabled: bool = True,
    policy: Policy | str | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
) -> Autocast | AutocastSpec:
    """Run ``fun`` with automatic mixed precision (torch's ``autocast``, as a function transformation).

    Matmuls and convolutions run in ``dtype`` (float16 on ``device_type="gpu"``, bfloat16 on
    ``"cpu"``/``"tpu"``), numerically sensitive ops in float32, multi-input ops at their widest
    input; the op lists are ``policy`` (see :mod:`jamp.casting.oplists`). Use as ``autocast(f)``,
    ``@autocast`` or ``@autocast(dtype=jnp.bfloat16)``. Inside another autocast function,
    ``autocast(g, enabled=False)`` runs ``g`` as written and ``autocast(g, dtype=...)`` switches the
    dtype for ``g``; ``with jamp.autocast(enabled=False):`` inside ``fun`` does the same for a block.
    Outputs keep the dtypes ``fun`` declares (or the policy's output dtype).

    Arrays and Python floats (weak-typed, as under jax.jit) are traced; bools, ints, strings and other
    objects are static, part of the cache key; inside an Equinox module only arrays are traced, as under
    ``eqx.filter_jit``; ``static_argnums``/``static_argnames`` make any argument static. As with jax.jit,
    arrays that ``fun`` closes over are constants of the trace, except for an NNX or Equinox module (or a
    bound method of one) given as ``fun``, whose current arrays are inputs of every call.
    """
    options = {
        "dtype": dtype,
        "device_type": device_type,
        "enabled": enabled,
        "cache_enabled": cache_enabled,
        "policy": policy,
        "static_argnums": static_argnums,
        "static_argnames": static_argnames,
    }
    if fun is None:
        return AutocastSpec(options)
    if not callable(fun):
        raise torch_names.autocast_positional((fun,), options, _DEFAULT_OPTIONS)
    from jamp.casting import equinox_module, nnx_module  # they subclass Autocast

    for bound_module, module_autocast in (
        (nnx_module.bound_module, nnx_module.ModuleAutocast),
        (equinox_module.bound_module, equinox_module.EquinoxAutocast),
    ):
        bound = bound_module(fun)
        if bound is not None:
            return module_autocast(fun, *bound, **options)
    return Autocast(fun, **options)


_DEFAULT_OPTIONS = {
    name: p.default for name, p in inspect.signature(autocast).parameters.items() if p.kind is p.KEYWORD_ONLY
}


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
        if dtype is None or not tracing_depth():
            return fun(*args, **kwargs)
        cast = lambda x: x.astype(dtype) if _is_dynamic(x) and is_eligible(jnp.result_type(x)) else x  # noqa: E731
        args, kwargs = jax.tree.map(cast, (args, kwargs))
        with jax.named_scope(marker_for(Region(OFF))):
            return fun(*args, **kwargs)

    return wrapper
