"""A call's signature: which arguments are traced, the cache key, and the warning for a cache that keeps missing.

As under ``jax.jit``, arrays and Python floats (weak-typed) are traced and everything else (bools, ints,
strings, other objects) is static, part of the cache key; inside an Equinox module only arrays are traced, as
under ``eqx.filter_jit``. ``static_argnums``/``static_argnames`` make any argument static. The same split
serves ``jamp.lower_precision`` (:func:`is_dynamic`).
"""

from __future__ import annotations

import collections
import inspect
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jamp._arguments import shown
from jamp.casting.adapters.frameworks import equinox_module_type

# Traces of one array signature after which a static value that keeps changing is reported, once.
RETRACE_WARNING = 16
# Python scalars that autocast traces, weak-typed, as jax.jit does. bool and int stay static: they
# size shapes, index, count loops and pick branches; strings, None and other objects are static too.
_TRACED_SCALARS = (float, complex)


def is_dynamic(x: Any) -> bool:
    """An array (or a tracer): always an input of the traced program."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _is_traced(x: Any) -> bool:
    """A leaf of the arguments that becomes an input of the traced program (not part of the cache key)."""
    return is_dynamic(x) or isinstance(x, _TRACED_SCALARS)


def traced_mask(tree: Any) -> tuple[bool, ...]:
    """For each leaf of ``tree``, whether it is traced. Inside an Equinox module only arrays are, as under
    ``eqx.filter_jit``: its other leaves (MaxPool's ``-inf`` init, a dropout rate, activation functions) are
    configuration that its code may use in Python (a traced MaxPool init has no gradient rule)."""
    module_type = equinox_module_type()
    if module_type is None:
        return tuple(_is_traced(x) for x in jax.tree.leaves(tree))
    mask: list[bool] = []
    for sub in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, module_type)):
        if isinstance(sub, module_type):
            mask.extend(is_dynamic(x) for x in jax.tree.leaves(sub))
        else:
            mask.append(_is_traced(sub))
    return tuple(mask)


def hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def same(a: Any, b: Any) -> bool:
    """Whether two static values hit the same cache entry (an unhashable value never does)."""
    if not (hashable(a) and hashable(b)):
        return False
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 (an == that gives no bool)
        return False


def static_argnums(value: Any) -> tuple[int, ...]:
    """An int or a collection of ints (negative ones count from the end of each call's arguments)."""
    nums = (value,) if isinstance(value, numbers.Integral) else value
    if isinstance(nums, Iterable) and not isinstance(nums, str):
        nums = tuple(nums)
        if all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in nums):
            return tuple(sorted({int(i) for i in nums}))
    raise TypeError(f"static_argnums must be an int or a sequence of ints, got {value!r}")


def static_argnames(value: Any) -> tuple[str, ...]:
    """A str or a collection of strs."""
    names = (value,) if isinstance(value, str) else value
    if isinstance(names, Iterable):
        names = tuple(names)
        if all(isinstance(n, str) for n in names):
            return tuple(set(names))
    raise TypeError(f"static_argnames must be a str or a sequence of strs, got {value!r}")


class Signature(NamedTuple):
    """What a trace depends on: the traced inputs' avals and everything static."""

    avals: tuple
    treedef: Any  # of (non-static positional args, non-static keyword args)
    dynamic_mask: tuple[bool, ...]
    static_leaves: tuple
    static_args: dict  # position -> value
    static_kwargs: dict  # name -> value

    def rest(self, dynamic: Sequence) -> tuple[tuple, dict]:
        """The non-static ``(args, kwargs)`` with ``dynamic`` (values or tracers) in the traced places."""
        dyn, stat = iter(dynamic), iter(self.static_leaves)
        return jax.tree.unflatten(self.treedef, [next(dyn) if d else next(stat) for d in self.dynamic_mask])

    def arguments(self, dynamic: Sequence) -> tuple[list, dict]:
        """The call's ``(args, kwargs)`` with ``dynamic`` (values or tracers) in the traced places."""
        rest_args, kwargs = self.rest(dynamic)
        rest = iter(rest_args)
        n = len(rest_args) + len(self.static_args)
        args = [self.static_args[i] if i in self.static_args else next(rest) for i in range(n)]
        return args, {**kwargs, **self.static_kwargs}


def split(args: tuple, kwargs: dict, argnums: tuple[int, ...], argnames: tuple[str, ...]) -> tuple:
    """``(cache key, dynamic leaves, signature)`` of a call."""
    # as jax.jit: a negative index counts from the end of this call's positional arguments
    nums = sorted({i % len(args) for i in argnums if -len(args) <= i < len(args)})
    static_args = tuple((i, args[i]) for i in nums)
    static_kwargs = tuple(sorted((k, kwargs[k]) for k in argnames if k in kwargs))
    rest_args = tuple(a for i, a in enumerate(args) if i not in nums)
    rest_kwargs = {k: v for k, v in kwargs.items() if k not in argnames}
    leaves, treedef = jax.tree.flatten((rest_args, rest_kwargs))
    mask = traced_mask((rest_args, rest_kwargs))
    dynamic = [x for x, d in zip(leaves, mask) if d]
    static_leaves = tuple(x for x, d in zip(leaves, mask) if not d)
    avals = tuple(jax.typeof(x) for x in dynamic)
    key = (treedef, mask, static_leaves, static_args, static_kwargs, avals)
    return key, dynamic, Signature(avals, treedef, mask, static_leaves, dict(static_args), dict(static_kwargs))


def name_of(fun: Any) -> str:
    return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or type(fun).__name__


class ArgumentNames:
    """The names a user gave ``fun``'s arguments, for messages about them (``config['lr']``)."""

    def __init__(self, fun: Callable):
        self.fun = fun

    def positional(self, i: int) -> str:
        try:
            params = list(inspect.signature(self.fun).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            return f"args[{i}]"
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if i < len(positional):
            return positional[i]
        star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
        return f"{star}[{i - len(positional)}]"

    def leaves(self, signature: Signature, dynamic: Sequence) -> list[str]:
        """The name of every leaf of the non-static arguments, in flattening order."""
        rest_args, rest_kwargs = signature.rest(dynamic)
        static = signature.static_args
        positions = [i for i in range(len(rest_args) + len(static)) if i not in static]
        names = []
        for path, _ in jax.tree_util.tree_flatten_with_path((rest_args, rest_kwargs))[0]:
            top = self.positional(positions[path[1].idx]) if path[0].idx == 0 else path[1].key
            names.append(top + jax.tree_util.keystr(path[2:]))
        return names

    def traced_note(self, error: Exception, signature: Signature, dynamic: Sequence) -> str:
        """JAX names the traced inputs ``dynamic[i]``: say which argument each one is."""
        names = [n for n, traced in zip(self.leaves(signature, dynamic), signature.dynamic_mask) if traced]
        cited = sorted({int(i) for i in re.findall(r"dynamic\[(\d+)\]", str(error))})
        which = ", ".join(f"dynamic[{i}] is {names[i]}" for i in cited if i < len(names))
        return (
            f"jamp.autocast({name_of(self.fun)}): {which + '. ' if which else ''}jamp.autocast traces array "
            "arguments and Python floats, as jax.jit does (bools, ints, strings and other objects are "
            "static). To use a value in Python control flow, make it static with static_argnums or "
            "static_argnames."
        )


class _TraceCount:
    """Traces of one array signature: how many, the last static values, how often each changed."""

    def __init__(self, values: tuple):
        self.count, self.values, self.changes = 1, values, collections.Counter()


class Retraces:
    """Counts the traces of each array signature and warns once when one has been traced again and again
    because a static value (a Python int, a string, an unhashable object...) keeps changing: the silent slow
    path of a cache."""

    def __init__(self, names: ArgumentNames, size: int):
        self.names, self.size = names, size
        self.counts: collections.OrderedDict = collections.OrderedDict()  # array signature -> _TraceCount
        self.warned = False

    def count(self, signature: Signature, dynamic: Sequence) -> None:
        values = (*signature.static_leaves, *signature.static_args.values(), *signature.static_kwargs.values())
        try:
            key = (signature.avals, signature.treedef, signature.dynamic_mask, tuple(signature.static_args),
                   tuple(signature.static_kwargs))  # fmt: skip
            count = self.counts.get(key)
        except TypeError:  # an unhashable pytree node: nothing to count by
            return
        if count is None:
            self.counts[key] = _TraceCount(values)
            if len(self.counts) > self.size:
                self.counts.popitem(last=False)
            return
        self.counts.move_to_end(key)
        count.count += 1
        count.changes.update(i for i, (a, b) in enumerate(zip(values, count.values)) if not same(a, b))
        count.values = values
        if count.count > RETRACE_WARNING and not self.warned and count.changes:
            self.warned = True
            warnings.warn(self._message(signature, dynamic, values, count), UserWarning, stacklevel=4)

    def _message(self, signature: Signature, dynamic: Sequence, values: tuple, count: _TraceCount) -> str:
        leaf_names = self.names.leaves(signature, dynamic)
        names = (
            [n for n, d in zip(leaf_names, signature.dynamic_mask) if not d]
            + [self.names.positional(i) for i in signature.static_args]
            + list(signature.static_kwargs)
        )
        i, changed = count.changes.most_common(1)[0]
        if hashable(values[i]):
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
        return (
            f"jamp.autocast({name_of(self.names.fun)}) has traced the same array shapes and dtypes {count.count} "
            f"times because {why}."
        )
