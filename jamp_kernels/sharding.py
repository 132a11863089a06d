"""Run the Pallas kernel shard by shard on sharded gradients.

A ``pallas_call`` is opaque to XLA's SPMD partitioner, which would all-gather every sharded gradient to
feed it. Wrapping the kernel in ``shard_map`` with the gradients' own partition specs keeps every shard
on its device; only the scalar flag crosses devices (``pmax``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

LeafFn = Callable[[jax.Array, list], tuple[list, jax.Array]]


class Placement(NamedTuple):
    mesh: Any
    specs: tuple[P, ...]
    axes: tuple[str, ...]


def _sharding(leaf: Any) -> Any:
    """Concrete arrays know their sharding; under ``jit`` only Explicit mesh axes are visible in the type."""
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else jax.typeof(leaf).sharding


def _axes(spec: P) -> set[str]:
    return {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}


def placement(leaves: Sequence[Any]) -> Placement | None:
    """The mesh and partition specs of ``leaves``, or None when no leaf is split across devices."""
    shardings = [_sharding(g) for g in leaves]
    split = [s for s in shardings if isinstance(s, NamedSharding) and _axes(s.spec)]
    if not split:
        return None
    mesh = split[0].mesh
    specs = tuple(s.spec if isinstance(s, NamedSharding) and _axes(s.spec) else P() for s in shardings)
    used = set().union(*map(_axes, specs))
    return Placement(mesh, specs, tuple(a for a in mesh.axis_names if a in used))


def shard_local(fn: LeafFn, inv: jax.Array, leaves: list, where: Placement | None) -> tuple[list, jax.Array]:
    """``fn(inv, leaves)`` on each device's shards; the flag is OR-ed over the axes the leaves are split on.

    ``check_vma=False`` because interpret-mode ``pallas_call`` fails jax 0.10.2's varying-axes check; the
    explicit ``pmax`` is what makes the replicated flag correct.
    """
    if where is None:
        return fn(inv, leaves)

    def local(inv, *shards):
        outs, found = fn(inv, list(shards))
        return (*outs, lax.pmax(found, where.axes))

    *outs, found = jax.shard_map(local, mesh=where.mesh, in_specs=(P(), *where.specs),
                                 out_specs=(*where.specs, P()), check_vma=False)(inv, *leaves)
    return outs, found
