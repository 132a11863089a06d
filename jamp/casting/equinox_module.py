"""``jamp.autocast(module)`` for an Equinox module (or a method of one).

An Equinox module is an immutable pytree: training makes a new module each step. Wrapped as a plain callable,
its arrays would be constants of the trace, and each new module a new autocast with a cold cache (a trace and
a compile per step). Here the module is an argument of every call, so its arrays are inputs of the program,
and every autocast of a module with the same options shares one cache, keyed by the module's structure and
static fields, as ``eqx.filter_jit`` caches. The autocast is itself a pytree whose leaves are the module's,
so ``eqx.filter_jit(jamp.autocast(model))`` traces the weights instead of closing over them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax

from jamp.casting.transform import Autocast, equinox_module_type

# The keyword the module travels under through the signature cache: no Python parameter has this name, and it
# names the module's leaves in messages ("<module>.layers[0].weight").
_MODULE = "<module>"
# (method, options) -> the cache, its lock and the trace counts that autocasts of such modules share.
_SHARED: dict[tuple, tuple] = {}
_SHARED_LOCK = threading.Lock()


def bound_module(fun: Any) -> tuple[Any, Callable] | None:
    """``(module, unbound method)`` when ``fun`` is an Equinox module (a method wrapped by Equinox is one) or a
    bound method of one, else None."""
    module_type = equinox_module_type()
    if module_type is None:
        return None
    if isinstance(fun, module_type):
        return fun, type(fun).__call__
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, module_type) and hasattr(fun, "__func__"):
        return owner, fun.__func__
    return None


@jax.tree_util.register_pytree_node_class
class EquinoxAutocast(Autocast):
    """The :class:`Autocast` of an Equinox module: the module is an argument of every call."""

    def __init__(self, fun: Callable, module: Any, method: Callable, **options: Any):
        super().__init__(fun, **options)
        self._module, self._method = module, method
        # the options as validated (hashable): the pytree's aux data and, with the method, the shared cache's key
        self._options = (
            ("dtype", self._dtype),
            ("device_type", self._device_type),
            ("enabled", self.enabled),
            ("cache_enabled", self.cache_enabled),
            ("policy", self._policy_arg),
            ("static_argnums", self.static_argnums),
            ("static_argnames", tuple(sorted(self.static_argnames))),
        )
        with _SHARED_LOCK:
            self._cache, self._cache_lock, self._traces = _SHARED.setdefault(
                (method, self._options), (self._cache, self._cache_lock, self._traces)
            )

    def _prepare(self, args: tuple, kwargs: dict):
        return super()._prepare(args, {**kwargs, _MODULE: self._module})

    def _invoke(self, args: list, kwargs: dict) -> Any:
        module = kwargs.pop(_MODULE)
        return self._checked_outputs(self._method(module, *args, **kwargs))

    # -- a pytree: the module's leaves ------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self._module,), (self._method, self._options)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> EquinoxAutocast:
        method, options = aux
        (module,) = children
        fun = (
            module
            if method is vars(type(module)).get("__call__", type(module).__call__)
            else functools.partial(method, module)
        )
        return cls(fun, module, method, **dict(options))
