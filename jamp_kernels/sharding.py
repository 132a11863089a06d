"""Run the Pallas kernel shard by shard on sharded gradients.

A ``pallas_call`` is opaque to XLA's SPMD partitioner, which would all-gather every sharded gradient to
feed it. Both paths below keep every shard on its device and OR the scalar flag across the mesh (``pmax``):

- Explicit mesh axes (``jax.make_mesh``'s default) show the partition specs in the leaves' types, so the
  kernel is wrapped in ``shard_map`` with those specs.
- Auto mesh axes hide the specs until XLA partitions the program, so the kernel is wrapped in
  ``custom_partitioning``, whose callback receives the shardings XLA chose. On a single device, or
  inside ``shard_map``/``pmap``, that wrapper lowers to the plain kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LeafFn = Callable[[jax.Array | None, list], tuple[list, jax.Array]]
"""``fn(inv, leaves) -> (outs, found)``: ``outs`` are per-leaf outputs shaped like ``leaves`` (none for a
check that only reads); ``inv`` is a replicated operand or None."""


def _is_split(spec: P) -> bool:
    return any(entry is not None for entry in spec)


def _mesh_or(fn: LeafFn, mesh, inv: jax.Array | None, leaves: list) -> tuple[jax.Array, ...]:
    """``fn`` on local shards, with the flag OR-ed over every mesh axis."""
    outs, found = fn(inv, leaves)
    return (*outs, lax.pmax(found, tuple(mesh.axis_names)))


def _split_operands(inv: jax.Array | None, operands: tuple) -> tuple[jax.Array | None, list]:
    return (None, list(operands)) if inv is None else (operands[0], list(operands[1:]))


def _shard_map(fn: LeafFn, inv: jax.Array | None, leaves: list, writes: bool) -> tuple[list, jax.Array]:
    """``check_vma=False`` because interpret-mode ``pallas_call`` fails jax 0.10.2's varying-axes check;
    the ``pmax`` in ``_mesh_or`` is what makes the replicated flag correct."""
    mesh = next(jax.typeof(g).sharding.mesh for g in leaves if _is_split(jax.typeof(g).sharding.spec))
    specs = tuple(jax.typeof(g).sharding.spec for g in leaves)
    head = () if inv is None else (inv,)

    def local(*operands):
        return _mesh_or(fn, mesh, *_split_operands(inv, operands))

    *outs, found = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*(P() for _ in head), *specs),
        out_specs=(*(specs if writes else ()), P()),
        check_vma=False,
    )(*head, *leaves)
    return outs, found


def _custom_partitioned(fn: LeafFn, inv: jax.Array | None, leaves: list, writes: bool) -> tuple[list, jax.Array]:
    head = () if inv is None else (inv,)

    def plain(*operands):
        outs, found = fn(*_split_operands(inv, operands))
        return (*outs, found)

    op = custom_partitioning(plain)

    def shardings(mesh, arg_shapes):
        """Each leaf's output keeps the leaf's sharding; inv_scale and the flag are replicated.

        A leaf split unevenly is replicated instead: XLA pads its last shard, and the kernel would
        read the padding (a false found_inf was observed).
        """
        replicated = NamedSharding(mesh, P())

        def even(a):
            try:
                a.sharding.shard_shape(a.shape)
            except ValueError:
                return replicated
            return a.sharding

        specs = [even(a) for a in arg_shapes[len(head) :]]
        return (*(specs if writes else ()), replicated), (*(replicated for _ in head), *specs)

    def partition(mesh, arg_shapes, result_shape):
        def lower(*operands):
            return _mesh_or(fn, mesh, *_split_operands(inv, operands))

        return (mesh, lower, *shardings(mesh, arg_shapes))

    dims = [tuple(f"leaf{i}_dim{d}" for d in range(g.ndim)) for i, g in enumerate(leaves)]
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, args, result: shardings(mesh, args)[0],
        sharding_rule=SdyShardingRule(
            operand_mappings=(*(("inv_pair",) for _ in head), *dims), result_mappings=(*(dims if writes else ()), ())
        ),
    )

    # custom_partitioning has no batching rule; under vmap, batch the plain kernel (pallas_call has one).
    batchable = jax.custom_batching.custom_vmap(op)

    @batchable.def_vmap
    def _(axis_size, in_batched, *args):
        in_axes = [0 if batched else None for batched in in_batched]
        outs = jax.vmap(plain, in_axes=in_axes, axis_size=axis_size)(*args)
        return outs, (True,) * len(outs)

    *outs, found = batchable(*head, *leaves)
    return outs, found


def _types_show_shardings(leaves: list) -> bool:
    """Whether the leaves' types hold their shardings (explicit mesh axes): then a spec that splits nothing
    means a replicated leaf, which ``fn`` can read whole."""
    mesh = jax.typeof(leaves[0]).sharding.mesh
    return any(axis_type == jax.sharding.AxisType.Explicit for axis_type in getattr(mesh, "axis_types", ()))


def shard_local(fn: LeafFn, inv: jax.Array | None, leaves: list, *, writes: bool = True) -> tuple[list, jax.Array]:
    """``fn(inv, leaves)`` evaluated per shard, never on gathered gradients; the flag covers every shard.
    ``writes=False``: ``fn`` returns no per-leaf outputs (a check that only reads)."""
    if any(_is_split(jax.typeof(g).sharding.spec) for g in leaves):
        return _shard_map(fn, inv, leaves, writes)
    if _types_show_shardings(leaves):
        return fn(inv, leaves)  # replicated under explicit axes (custom_partitioning fails there on jax 0.12)
    return _custom_partitioned(fn, inv, leaves, writes)


def shard_local_check(check: Callable[[list], jax.Array], leaves: list) -> jax.Array:
    """``check(leaves)`` on each device's own shards, the flag OR-ed over the mesh: for checks that the
    partitioner cannot split by itself (a Pallas kernel, slices of flattened leaves)."""
    return shard_local(lambda _, local: ([], check(local)), None, leaves, writes=False)[1]
