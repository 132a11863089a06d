"""``jamp.autocast(module)``: a Flax NNX or Equinox module (or a bound method of one) as the function.

A traced function keeps the arrays it closes over as constants, so a module wrapped as a plain callable would
compute with the weights of the first call forever. Here the module is an argument of every call instead:

* NNX: a mutable object. It is lifted with the call's other NNX graph nodes
  (:mod:`jamp.casting.adapters.nnx_nodes`): its current state is an input of the program, and what the call
  writes to it is written back.
* Equinox: an immutable pytree; training makes a new module each step. Its arrays are inputs of the program,
  and every autocast of a module with the same options shares one cache, keyed by the module's structure and
  static fields, as ``eqx.filter_jit`` caches (each new module would otherwise trace and compile again). The
  autocast is itself a pytree whose leaves are the module's, so ``eqx.filter_jit(jamp.autocast(model))``
  traces the weights instead of closing over them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax

from jamp.casting.adapters.frameworks import bound_module, equinox_module_type, flax_nnx
from jamp.casting.transformation import Autocast

# The keyword the module travels under through the signature cache: no Python parameter has this name, and it
# names the module's leaves in messages ("<module>.layers[0].weight").
_MODULE = "<module>"


class ModuleAutocast(Autocast):
    """An :class:`Autocast` whose ``method`` is called on ``module``, an argument of every call."""

    def __init__(self, fun: Callable, module: Any, method: Callable, **options: Any):
        super().__init__(fun, **options)
        self._module, self._method = module, method

    def _prepare(self, args: tuple, kwargs: dict) -> tuple:
        return super()._prepare(args, {**kwargs, _MODULE: self._module})

    def _invoke(self, args: list, kwargs: dict) -> Any:
        module = kwargs.pop(_MODULE)
        return self._checked_outputs(self._method(module, *args, **kwargs))


# (method, options) -> the cache, its lock and the trace counts that autocasts of such Equinox modules share.
_SHARED: dict[tuple, tuple] = {}
_SHARED_LOCK = threading.Lock()


@jax.tree_util.register_pytree_node_class
class EquinoxAutocast(ModuleAutocast):
    """The :class:`ModuleAutocast` of an Equinox module: a pytree of the module's leaves, with a shared cache."""

    def __init__(self, fun: Callable, module: Any, method: Callable, **options: Any):
        super().__init__(fun, module, method, **options)
        # the options as validated (hashable): the pytree's aux data and, with the method, the shared cache's key
        self._options = (
            ("dtype", self._dtype),
            ("device_type", self._device_type),
            ("enabled", self.enabled),
            ("cache_enabled", self.cache_enabled),
            ("policy", self._policy_arg),
            ("static_argnums", self.static_argnums),
            ("static_argnames", tuple(sorted(self.static_argnames))),
            ("recompute", self.recompute),
        )
        with _SHARED_LOCK:
            self._cache, self._cache_lock, self._traces = _SHARED.setdefault(
                (method, self._options), (self._cache, self._cache_lock, self._traces)
            )

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self._module,), (self._method, self._options)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> EquinoxAutocast:
        method, options = aux
        (module,) = children
        fun = module if method is type(module).__call__ else functools.partial(method, module)
        return cls(fun, module, method, **dict(options))


def _nnx_type() -> type | None:
    nnx = flax_nnx()
    return None if nnx is None else nnx.Pytree


# The module types autocast adapts, looked up when a function is wrapped -> the Autocast that adapts them.
ADAPTERS: tuple[tuple[Callable[[], type | None], type[ModuleAutocast]], ...] = (
    (_nnx_type, ModuleAutocast),
    (equinox_module_type, EquinoxAutocast),
)


def module_autocast(fun: Callable, options: dict) -> ModuleAutocast | None:
    """The adapter's autocast when ``fun`` is a module (or a bound method of one) of a known framework."""
    for module_type, adapter in ADAPTERS:
        bound = bound_module(fun, module_type())
        if bound is not None:
            return adapter(fun, *bound, **options)
    return None
