"""XLA implementation: plain jnp code that XLA fuses into its consumers (the fallback off CUDA)."""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jamp_kernels import leafwise, sharding
from jamp_kernels.platforms import per_platform

VIEWS_PER_LOOP = 16
"""Equal-length views of the gradients that one fused loop of the CPU check reads side by side: 16 input
streams and one output stream, within what a CPU's hardware prefetchers follow; the loop writes a bool per
position, 1/64 of the bytes it reads."""

SPLIT_AT = 2**16
"""Leaves of at least this many elements are cut into ``VIEWS_PER_LOOP`` views, a loop of their own. A
smaller leaf is covered by one or two views of a power-of-two length, and views of equal length share
loops: 1000 bias vectors of one size take 125 loops instead of 1000 reductions."""


def unscale(grads: Any, inv_scale: Any) -> Any:
    """Multiply every floating leaf by ``inv_scale`` and round once to its dtype.

    ``inv_scale`` is a scalar or an :func:`inverse` pair; the product is computed in the leaf's opmath type.
    The opmath type is torch's: float32 for float16, bfloat16 and float32 leaves, float64 for float64.
    Plain jnp that XLA fuses into the optimizer's loops; integer, bool and empty leaves pass through.
    Unlike :func:`unscale_and_check` it does not look for inf/NaN.

    Args:
        grads: a pytree of JAX or NumPy arrays (real floating, integer or bool).
        inv_scale: the inverse scale: a positive finite scalar, or a ``[factor, power_of_two]`` pair whose
            product it is (``jamp_kernels.inverse(scale)``).

    Returns:
        ``grads``' structure with each floating leaf times ``inv_scale``, in its dtype.

    Raises:
        TypeError: for a leaf that is not an array (a Python number) or is complex, or an ``inv_scale``
            that is not real.
        ValueError: for an ``inv_scale`` of another shape, or concrete and not finite and positive.

    Examples:
        >>> import jax.numpy as jnp, jamp_kernels
        >>> jamp_kernels.unscale({"w": jnp.array([2.0, 4.0], jnp.bfloat16)}, 0.5)
        {'w': Array([1, 2], dtype=bfloat16)}
        >>> inv_scale = jamp_kernels.inverse(jnp.float32(2.0**16))
        >>> jamp_kernels.unscale([jnp.array([65536.0])], inv_scale)
        [Array([1.], dtype=float32)]
    """
    leaves, treedef = leafwise.flatten(grads)
    factor, power = (leafwise.once(v) for v in leafwise.inv_scale_pair(inv_scale))
    keep = leafwise.once(leafwise.keeps(factor, power))
    spread = leafwise.Spread()

    def scale(g):
        op = leafwise.opmath(g.dtype)
        return leafwise.scale(g, spread("factor", factor, g, op), spread("power", power, g, op), keep)

    return jax.tree.unflatten(treedef, [scale(g) if leafwise.is_scaled(g) else g for g in leaves])


def _view_length(size: int) -> int:
    if size >= SPLIT_AT:
        return -(-size // VIEWS_PER_LOOP)
    return 1 << (size.bit_length() - 1)  # the largest power of two <= size


def views(leaf: jax.Array) -> list[jax.Array]:
    """``leaf`` flattened and covered by contiguous slices of one length (:func:`_view_length`). The last
    one may overlap its neighbour: no slice needs padding, at the price of reading the overlap twice (up to
    almost a whole view for a leaf just over a power of two below ``SPLIT_AT``, which fits in a cache)."""
    flat, length = leaf.reshape(-1), _view_length(leaf.size)
    starts = list(range(0, leaf.size - length + 1, length))
    if starts[-1] + length < leaf.size:
        starts.append(leaf.size - length)
    return [jax.lax.slice(flat, (s,), (s + length,)) for s in starts]


def _loop_flags(group: list[jax.Array]) -> jax.Array:
    """One fused elementwise loop: ``sum(v - v)`` across the views is 0 where all are finite and NaN where
    any is inf/NaN (a sum never drops a NaN); it writes ``isnan`` of that, a bool per position."""
    acc = group[0] - group[0]
    for v in group[1:]:
        acc = acc + (v - v)
    return jnp.isnan(acc)


def _folded(leaves: list[jax.Array]) -> jax.Array:
    same_length: dict = collections.defaultdict(list)  # (length, dtype) -> views
    for g in leaves:
        cut = views(g)
        same_length[cut[0].size, g.dtype].extend(cut)
    flags = [
        _loop_flags(vs[i : i + VIEWS_PER_LOOP])
        for vs in same_length.values()
        for i in range(0, len(vs), VIEWS_PER_LOOP)
    ]
    # One reduction of all the loops' short outputs (1/64 of the bytes they read), exact on any backend:
    # XLA:CPU splits an ``any`` of their concatenation back into a chain of reduce-window kernels per loop
    # (three times the kernels to compile, the same time to run); a max over a uint8 copy stays one.
    return jnp.max(jnp.concatenate(flags).astype(jnp.uint8)) > 0


def _reduced(leaves: list[jax.Array]) -> jax.Array:
    return jnp.any(jnp.stack([jnp.isnan(jnp.sum(g - g)) for g in leaves]))


CHECK_OF_PLATFORM = {"cpu": functools.partial(sharding.shard_local_check, _folded), "default": _reduced}
"""How the check reads the gradients on each platform; both forms are exact. XLA:CPU does not split a float
reduction across threads (its fusion gets no ``outer_dimension_partitions``) and pays a fixed cost for each
one, while it splits elementwise loops, so there loops over views (:func:`views`) read the gradients
(benchmarks/scaler_overhead.py measures both forms: the loops cost 0.02-0.04 of bare Adam less per step). XLA:GPU and TPU reduce at memory speed, one reduction
per leaf; slicing a flattened leaf would cost a TPU a relayout of its tiled arrays. The CPU form reads a
sharded leaf shard by shard (slices of a sharded leaf would make XLA's partitioner move the data); XLA
partitions the reductions of the other form by itself."""


def has_nonfinite(grads: Any) -> jax.Array:
    """Scalar bool: any inf/NaN in any floating leaf, exact, in the form :data:`CHECK_OF_PLATFORM` picks for
    the platform the program is lowered for.

    Both forms test ``v - v``: 0 for finite values, NaN for inf/NaN. ``~isfinite(max|g|)`` is not exact
    (XLA:CPU's vectorised float32 ``max`` loses NaNs), and ``any(~isfinite(g))`` writes a bool per element.
    """
    leaves, _ = leafwise.flatten(grads)
    work = [g for g in leaves if leafwise.is_scaled(g)]
    if not work:
        return jnp.zeros((), jnp.bool_)
    return per_platform(CHECK_OF_PLATFORM, work)
