"""``jamp.autocast(module)`` for a Flax NNX module (or a bound method of one).

A traced function keeps the arrays it closes over as constants, so a module wrapped as a plain callable
would compute with the weights of the first call forever. Here the module's current state is an input of
every call (its graph structure is part of the cache key), and what the call writes to the module (batch
statistics, RNG counts) is written back afterwards, as ``nnx.jit`` does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from jamp.casting.transform import Autocast

# The keyword the state travels under through the signature cache: no Python parameter has this name, and it
# names the state's leaves in messages ("<module state>['lin']['kernel'].value").
_STATE = "<module state>"


def bound_module(fun: Any) -> tuple[Any, Callable] | None:
    """``(module, unbound method)`` when ``fun`` is an NNX object or a bound method of one, else None.

    flax is looked up, not imported: a program that holds an NNX object has imported it already.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    if isinstance(fun, nnx.Pytree):
        return fun, type(fun).__call__
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, nnx.Pytree) and hasattr(fun, "__func__"):
        return owner, fun.__func__
    return None


class ModuleAutocast(Autocast):
    """The :class:`Autocast` of an NNX module: ``(graphdef, state)`` is an argument of every call."""

    def __init__(self, fun: Callable, module: Any, method: Callable, **options: Any):
        super().__init__(fun, **options)
        self._module, self._method = module, method

    def _prepare(self, args: tuple, kwargs: dict):
        from flax import nnx

        return super()._prepare(args, {**kwargs, _STATE: nnx.split(self._module)})

    def _invoke(self, args: list, kwargs: dict) -> tuple[Any, Any]:
        """(the method's outputs, the variables it changed): the changed ones are new tracers."""
        from flax import nnx

        graphdef, state = kwargs.pop(_STATE)
        before = {path: jax.tree.leaves(v) for path, v in nnx.to_flat_state(state)}  # merge reuses the Variables
        module = nnx.merge(graphdef, state)
        out = self._checked_outputs(self._method(module, *args, **kwargs))
        new_graphdef, new_state = nnx.split(module)
        if new_graphdef != graphdef:
            raise ValueError(
                f"jamp.autocast({type(self._module).__name__}): the call changed the module's structure (it "
                "added, removed or replaced a submodule or a variable); jamp writes back the values of the "
                "module's variables, not new ones. Create them before the first autocast call.")
        changed = [(path, v) for path, v in nnx.to_flat_state(new_state)
                   if any(a is not b for a, b in zip(jax.tree.leaves(v), before[path]))]
        return out, nnx.from_flat_state(changed)

    def _n_outputs(self, out_tree) -> int:
        return out_tree.children()[0].num_leaves

    def _call(self, args: tuple, kwargs: dict) -> Any:
        from flax import nnx

        out, writes = super()._call(args, kwargs)
        if writes:
            nnx.update(self._module, writes)
        return out
