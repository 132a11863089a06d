"""``jamp.autocast(module)`` for a Flax NNX module (or a bound method of one).

A traced function keeps the arrays it closes over as constants, so a module wrapped as a plain callable would
compute with the weights of the first call forever. Here the module is an argument of every call, lifted with
the call's other NNX graph nodes (:mod:`jamp.casting.nnx_nodes`): its current state is an input of the
program, and what the call writes to it is written back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jamp.casting.nnx_nodes import flax_nnx
from jamp.casting.transform import Autocast

# The keyword under which the module travels through the signature cache (no Python parameter has this name).
_MODULE = "<module>"


def bound_module(fun: Any) -> tuple[Any, Callable] | None:
    """``(module, unbound method)`` when ``fun`` is an NNX object or a bound method of one, else None."""
    nnx = flax_nnx()
    if nnx is None:
        return None
    if isinstance(fun, nnx.Pytree):
        return fun, type(fun).__call__
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, nnx.Pytree) and hasattr(fun, "__func__"):
        return owner, fun.__func__
    return None


class ModuleAutocast(Autocast):
    """The :class:`Autocast` of an NNX module (or a bound method of one): the module is an argument of every
    call, lifted with the others."""

    def __init__(self, fun: Callable, module: Any, method: Callable, **options: Any):
        super().__init__(fun, **options)
        self._module, self._method = module, method

    def _prepare(self, args: tuple, kwargs: dict):
        return super()._prepare(args, {**kwargs, _MODULE: self._module})

    def _invoke(self, args: list, kwargs: dict) -> Any:
        module = kwargs.pop(_MODULE)
        return self._checked_outputs(self._method(module, *args, **kwargs))
