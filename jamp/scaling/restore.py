"""``jamp.from_restored``: a checkpoint restored without a target, put back into the structure it was saved from.

orbax restores a tree it is given no target for as nested dicts and lists (a NamedTuple becomes a dict of its
fields, a tuple a list), and refuses a target whose structure differs from the checkpoint's. A checkpoint
saved by a jamp whose ``ScalerState`` lacked some of the skipped-steps report's fields (``warn_after_skips``,
``warn_below_scale``, ``consecutive_skips``, ``warned``, ``skip_episodes``: :mod:`jamp.scaling.skip_episodes`), or
had one that is gone (``scaler_id``, a creation-order number of the release before), therefore restores only
without a target; this puts its values into the target's structure, leaves out what the target does not have,
and takes the missing fields from the target, as ``tx.init`` made them: the target scaler's thresholds, no skips
counted, no episode (a run of skips under way when it was saved is counted from the restore).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState

# ScalerState fields that a checkpoint saved by an older jamp lacks
ADDED_FIELDS = ("warn_after_skips", "warn_below_scale", "consecutive_skips", "warned", "skip_episodes")

_MISSING = object()


def _child(node: Any, key: Any) -> Any:
    """``node``'s child at one key of a target path, as orbax restores it without a target; _MISSING if absent."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return node.get(key.name, _MISSING) if isinstance(node, Mapping) else getattr(node, key.name, _MISSING)
    if isinstance(key, jax.tree_util.DictKey):
        return node.get(key.key, node.get(str(key.key), _MISSING)) if isinstance(node, Mapping) else _MISSING
    if isinstance(key, jax.tree_util.SequenceKey):
        if isinstance(node, Mapping):
            return node.get(str(key.idx), _MISSING)
        is_sequence = isinstance(node, Sequence) and not isinstance(node, str)
        return node[key.idx] if is_sequence and key.idx < len(node) else _MISSING
    return _MISSING


def _added_field_paths(target: Any) -> set[tuple]:
    """Paths, in ``target``, of the ScalerState fields that an older jamp did not save."""
    states = jax.tree_util.tree_flatten_with_path(target, is_leaf=scaler_state.is_scaler_state)[0]
    return {
        (*path, jax.tree_util.GetAttrKey(field))
        for path, st in states
        if isinstance(st, ScalerState)
        for field in ADDED_FIELDS
    }


def from_restored(target: Any, restored: Any) -> Any:
    """A checkpoint restored without a target, put back into the structure it was saved from.

    ``target``'s structure (``{"params": params, "opt_state": tx.init(params)}``, or its ``jax.eval_shape``)
    holding the values of ``restored``, what ``checkpointer.restore(path)`` returned without a target.

    orbax restores a checkpoint it is given no target for as nested dicts and lists (a NamedTuple such as
    :class:`jamp.ScalerState` becomes a dict of its fields), and refuses a target whose structure differs
    from the checkpoint's, as one saved by a jamp whose ``ScalerState`` lacked some fields does. Each leaf
    must have the target's shape and dtype (a ValueError names the path otherwise) and is placed with the
    target leaf's sharding when it has one. The skipped-steps fields of a scaler state that the checkpoint
    lacks (saved by an older jamp) are the target's (zeros where the target is a ``jax.eval_shape``: then the
    thresholds are 0, no episode is counted; build the target with ``tx.init`` to keep them).

    Args:
        target: a pytree of the structure to restore into, with arrays (or ``jax.ShapeDtypeStruct`` leaves)
            of the shapes, dtypes and shardings wanted; typically the tree that was saved, built afresh.
        restored: what the checkpointer restored without a target: nested dicts and lists holding arrays (a
            NamedTuple as a dict of its fields, a tuple as a list or as a dict keyed by the index as a string).

    Returns:
        A pytree with ``target``'s structure holding ``restored``'s values as JAX arrays.

    Raises:
        ValueError: when ``restored`` has nothing at a path of ``target`` (other than the fields an older
            jamp did not save), or a value of another shape or dtype.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> target = {"params": params, "opt_state": tx.init(params)}
        >>> restored = {  # as orbax restores it without a target: dicts of numpy arrays
        ...     "params": {"w": np.full(3, 2.0, np.float32)},
        ...     "opt_state": {**tx.init(params)._asdict(), "scale": np.float32(1024.0)},
        ... }
        >>> state = jamp.from_restored(target, restored)
        >>> opt_state = state["opt_state"]
        >>> state["params"]["w"], type(opt_state).__name__, jamp.get_scale(opt_state)
        (Array([2., 2., 2.], dtype=float32), 'ScalerState', Array(1024., dtype=float32))
    """
    added = _added_field_paths(target)
    keystr = jax.tree_util.keystr

    def value_at(path: tuple, leaf: Any) -> Any:
        node, want = restored, (tuple(np.shape(leaf)), jnp.result_type(leaf))
        for depth, key in enumerate(path):
            node = _child(node, key)
            if node is _MISSING and path in added:
                node = leaf if isinstance(leaf, jax.Array) else np.zeros(*want)  # as tx.init made it
                break
            if node is _MISSING:
                raise ValueError(
                    f"jamp.from_restored: the restored tree has nothing at {keystr(path[: depth + 1])}, "
                    f"where the target has {keystr(path)}; pass as target the tree that was saved "
                    "(its jax.eval_shape will do)"
                )
        value = np.asarray(node) if not isinstance(node, jax.Array) else node
        if (value.shape, value.dtype) != want:
            raise ValueError(
                f"jamp.from_restored: the restored value at {keystr(path)} is {value.dtype}"
                f"{list(value.shape)}, the target's is {want[1]}{list(want[0])}"
            )
        sharding = getattr(leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)

    return jax.tree_util.tree_map_with_path(value_at, target)
