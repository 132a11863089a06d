"""Flax NNX graph nodes under ``jamp.autocast``: modules among the arguments, and a module as the function.

An NNX module is a mutable object: a call may write to it (BatchNorm's running statistics, Dropout's RNG
count). A traced function sees copies, so what the copies receive is lost unless it is written back, as NNX's
own transformations (``nnx.jit``, ``nnx.grad``) do. Here every NNX graph node of a call (each one found among
the arguments, at any depth of their pytrees, and the module of ``jamp.autocast(module)``) is split into
``(graphdef, state)`` together, so shared references and RNG streams behave as under ``nnx.jit``; the state is
an input of the traced program, the call runs on merged copies, and the variables the call changed are
outputs, written back into the caller's objects afterwards.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from jamp.casting.adapters.frameworks import flax_nnx

# The keyword the nodes' state travels under through the signature cache: no Python parameter has this name,
# and it names the state's leaves in messages.
STATE = "<NNX state>"


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th graph node stood in the arguments (static: part of the cache key)."""

    index: int


def lift(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    """``(args, kwargs, nodes)`` with each NNX graph node replaced by a :class:`_Slot` and, when there are
    nodes, their ``nnx.split`` under :data:`STATE` in ``kwargs``."""
    nnx = flax_nnx()
    if nnx is None:
        return args, kwargs, ()
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    nodes: list = []
    for i, leaf in enumerate(leaves):
        if is_node(leaf):
            leaves[i] = _Slot(len(nodes))
            nodes.append(leaf)
    if not nodes:
        return args, kwargs, ()
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return args, {**kwargs, STATE: nnx.split(tuple(nodes))}, tuple(nodes)


def call(invoke: Callable, args: list, kwargs: dict) -> tuple[Any, Any]:
    """``(invoke's outputs, the variables it changed)``: ``invoke`` runs on merged copies of the lifted nodes."""
    if STATE not in kwargs:
        return _hinted(invoke, args, kwargs), None
    nnx = flax_nnx()
    kwargs = dict(kwargs)
    graphdef, state = kwargs.pop(STATE)
    before = {path: jax.tree.flatten(v) for path, v in nnx.to_flat_state(state)}  # merge reuses the Variables
    copies = nnx.merge(graphdef, state)
    args, kwargs = jax.tree.map(
        lambda x: copies[x.index] if isinstance(x, _Slot) else x, (args, kwargs), is_leaf=lambda x: isinstance(x, _Slot)
    )
    out = _hinted(invoke, args, kwargs)
    new_graphdef, new_state = nnx.split(copies)
    if new_graphdef != graphdef:
        raise ValueError(
            "jamp.autocast: the call changed the structure of an NNX module it was given: it added or removed "
            "a variable or submodule (`Module.sow` adds one), replaced one by another of a different structure, "
            "or changed a static attribute (a Python number or string) or a variable's metadata. nnx.jit "
            "carries such changes; jamp.autocast writes back the values of the variables the module had, any "
            "value, so create them before the call (in `__init__`, `nnx.Variable(None)` for a value filled "
            "later), keep counters in a Variable, and collect sown values with `nnx.capture(amp_call, "
            "nnx.Intermediate)(model, x)`, where `amp_call = jamp.autocast(lambda m, x: m(x))`."
        )
    changed = [(path, v) for path, v in nnx.to_flat_state(new_state) if _written(jax.tree.flatten(v), before[path])]
    return out, nnx.from_flat_state(changed)


def _hinted(invoke: Callable, args: list, kwargs: dict) -> Any:
    """``invoke(args, kwargs)``; flax's TraceContextError from inside it (a write to an NNX object the function
    closes over, which the trace cannot carry out) gets a note saying to pass the object as an argument."""
    try:
        return invoke(args, kwargs)
    except Exception as error:
        errors = sys.modules.get("flax.errors")
        if errors is not None and isinstance(error, errors.TraceContextError):
            error.add_note(
                "jamp.autocast: the function wrote to an NNX object it closes over, which a traced call cannot "
                "update (nnx.jit raises the same). Pass the module as an argument and jamp writes back what the "
                "call changed: `amp_call = jamp.autocast(lambda m, x: m(x))`, then `amp_call(model, x)`; or "
                "`jamp.autocast(model)(x)`."
            )
        raise


def _written(after: tuple[list, Any], before: tuple[list, Any]) -> bool:
    """Whether a variable's ``(leaves, treedef)`` changed: a new array, or a new structure of its value (a cache
    filled from None, emptied, or given new keys), which has other leaves, or none, or as many but other ones."""
    (leaves, treedef), (old_leaves, old_treedef) = after, before
    return treedef != old_treedef or any(a is not b for a, b in zip(leaves, old_leaves))


def write_back(nodes: tuple, writes: Any) -> None:
    """Update the caller's nodes with what the call wrote. A node that lives outside the transformation this
    call is traced in cannot take traced values: a jamp error says which form to write."""
    if not writes:
        return
    from flax.errors import TraceContextError

    try:
        flax_nnx().update(nodes, writes)
    except TraceContextError as error:
        names = ", ".join(sorted({type(node).__name__ for node in nodes}))
        raise ValueError(
            f"jamp.autocast: the call wrote to an NNX module ({names}) from outside the transformation it runs "
            "in (nnx.jit, nnx.grad, nnx.scan...), typically a `jamp.autocast(model)` made outside `nnx.jit` "
            "and called inside it, where nnx.jit hands the function a copy of the model. Pass the module "
            "through the transformation and autocast what it receives: `amp_call = jamp.autocast(lambda m, x: "
            "m(x))` once, then `amp_call(model, x)` inside the jitted function, on the `model` it was given "
            "(or `jamp.autocast(model)(x)` there)."
        ) from error
