"""Pallas kernel on the Triton backend: one launch unscales and checks a whole list of leaves.

This is torch's ``multi_tensor_apply`` for ``_amp_foreach_non_finite_check_and_unscale_``: the grid runs
over the blocks of every leaf in turn, each leaf keeps its own buffer and dtype (no concatenation, which
would cost a copy), and a binary tree of ``cond``s on the program id picks the leaf and block a program
works on. Every program writes one int32 flag; a tiny XLA reduction turns them into ``found_inf``
(deterministic, no zero-initialised atomic buffer). Leaves enter and leave the kernel as unsigned integers
of their width and are bitcast to their float type only for the arithmetic: a value the kernel returns
unchanged is then moved, never converted (interpret mode runs on XLA:CPU, which widens bfloat16 loads,
stores and selects to float32 and narrows them back with a convert that flushes subnormals on CPUs with
AVX512-BF16). The read-only check returns no values and takes the leaves as they are: a flushed subnormal
is still finite. Triton runs on Ampere and newer; the default Mosaic
GPU path of ``pallas_call`` is Hopper-only, so ``CompilerParams`` from ``pallas.triton`` selects Triton.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jamp_kernels import leafwise

BLOCK_BYTES = 16 * 1024
"""Bytes one program moves per leaf block (4096 float32): 32 elements a thread at 4 warps."""

NUM_WARPS = 4

MAX_LEAVES_PER_CALL = 64
"""Leaves per launch. Every leaf adds two pointer parameters (CUDA caps kernel parameters at 4 KiB, i.e.
about 250 leaves) and one branch to the kernel (code size, compile time; the branch tree is log2(64) = 6
deep). Larger pytrees take ceil(L / 64) launches: 16 for a 1000-leaf model."""

_WHOLE = pl.BlockSpec(memory_space=pl.ANY)
"""Leaves are passed whole: a program addresses its own block, so no program evaluates an index map
for every leaf (Pallas computes all block offsets at kernel entry)."""


class _Span(NamedTuple):
    """Where one leaf sits in the grid: programs ``first .. first + blocks - 1``; ``dtype`` is its float type."""

    dtype: np.dtype
    size: int
    block: int
    first: int
    blocks: int


def _layout(leaves: Sequence[jax.Array]) -> tuple[_Span, ...]:
    """The grid positions of float ``leaves`` (as if flat, before they are bitcast to their bits)."""
    spans, first = [], 0
    for g in leaves:
        if g.size >= 2**31:
            raise ValueError(f"the Pallas kernel indexes with int32; a leaf of {g.size} elements needs backend='xla'")
        block = min(BLOCK_BYTES // g.dtype.itemsize, pl.next_power_of_2(g.size))
        blocks = pl.cdiv(g.size, block)
        spans.append(_Span(np.dtype(g.dtype), g.size, block, first, blocks))
        first += blocks
    return tuple(spans)


def _leaf_block(span: _Span, x_ref, o_ref, inv, pid, masked: bool) -> jax.Array:
    """Check (and, given ``o_ref``, unscale) one block of one leaf; return its int32 non-finite flag.

    Only the ragged last block is masked: interpret mode pads it with NaN, a GPU load past the end reads
    garbage, and a store past the end corrupts memory. Full blocks stay unmasked so Triton can vectorise.
    """
    start = pl.multiple_of((pid - span.first) * span.block, span.block)
    window = pl.ds(start, span.block)
    mask = None
    if masked:
        mask = start + lax.broadcasted_iota(jnp.int32, (span.block,), 0) < span.size
    x = plt.load(x_ref.at[window], mask=mask)
    x = leafwise.from_bits(x, span.dtype) if x.dtype != span.dtype else x  # the check reads floats
    if o_ref is not None:
        plt.store(o_ref.at[window], leafwise.to_bits(leafwise.scale(x, *inv)), mask=mask)
    bad = jnp.logical_not(jnp.isfinite(x.astype(leafwise.opmath(x.dtype))))
    if mask is not None:
        bad = jnp.logical_and(bad, mask)
    return jnp.max(bad.astype(jnp.int32))


def _leaf_program(span: _Span, x_ref, o_ref, inv, pid) -> jax.Array:
    if span.size % span.block == 0:
        return _leaf_block(span, x_ref, o_ref, inv, pid, masked=False)
    last = span.first + span.blocks - 1
    return lax.cond(
        pid == last,
        lambda: _leaf_block(span, x_ref, o_ref, inv, pid, masked=True),
        lambda: _leaf_block(span, x_ref, o_ref, inv, pid, masked=False),
    )


def _select_leaf(pid, spans, x_refs, o_refs, inv) -> jax.Array:
    """Binary tree of ``cond``s on the program id: log2(L) scalar tests instead of a linear ``switch`` chain."""
    if len(spans) == 1:
        return _leaf_program(spans[0], x_refs[0], o_refs[0], inv, pid)
    mid = len(spans) // 2
    return lax.cond(
        pid < spans[mid].first,
        lambda: _select_leaf(pid, spans[:mid], x_refs[:mid], o_refs[:mid], inv),
        lambda: _select_leaf(pid, spans[mid:], x_refs[mid:], o_refs[mid:], inv),
    )


def _unscale_kernel(inv_ref, *refs, spans: tuple[_Span, ...]):
    n = len(spans)
    x_refs, o_refs, flag_ref = refs[:n], refs[n : 2 * n], refs[2 * n]
    flag_ref[0] = _select_leaf(pl.program_id(0), spans, x_refs, o_refs, (inv_ref[0], inv_ref[1]))


def _check_kernel(*refs, spans: tuple[_Span, ...]):
    x_refs, flag_ref = refs[:-1], refs[-1]
    flag_ref[0] = _select_leaf(pl.program_id(0), spans, x_refs, (None,) * len(spans), None)


def _out_struct(shape, dtype, like: Sequence[jax.Array]) -> jax.ShapeDtypeStruct:
    """Output type whose manual axes (inside ``shard_map``) vary wherever any of ``like`` varies."""
    varying = frozenset().union(*(jax.typeof(g).manual_axis_type.varying for g in like))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _launch(leaves: Sequence[jax.Array], inv: jax.Array | None, *, interpret: bool, donate: bool):
    """One ``pallas_call`` over ``leaves``: with ``inv``, unscale and check; without, check only (reads only)."""
    spans = _layout(leaves)
    flat = [g.reshape(-1) if inv is None else leafwise.to_bits(g.reshape(-1)) for g in leaves]
    programs = spans[-1].first + spans[-1].blocks
    flags = _out_struct((programs,), jnp.int32, flat)
    flag_spec = pl.BlockSpec((1,), lambda b: (b,))
    params = dict(
        grid=(programs,), compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1), interpret=interpret
    )
    if inv is None:
        flag_out = pl.pallas_call(
            functools.partial(_check_kernel, spans=spans),
            out_shape=flags,
            in_specs=[_WHOLE] * len(spans),
            out_specs=flag_spec,
            name="jamp_check",
            **params,
        )(*flat)
        return [], jnp.max(flag_out) > 0
    *outs, flag_out = pl.pallas_call(
        functools.partial(_unscale_kernel, spans=spans),
        out_shape=[_out_struct(g.shape, g.dtype, [g]) for g in flat] + [flags],
        in_specs=[pl.BlockSpec((2,), lambda b: (0,))] + [_WHOLE] * len(spans),
        out_specs=[_WHOLE] * len(spans) + [flag_spec],
        input_output_aliases={1 + i: i for i in range(len(flat))} if donate else {},
        name="jamp_unscale_and_check",
        **params,
    )(inv, *flat)
    return [leafwise.from_bits(o, g.dtype).reshape(g.shape) for o, g in zip(outs, leaves)], jnp.max(flag_out) > 0


def _grouped(
    leaves: Sequence[jax.Array], inv: jax.Array | None, *, interpret: bool, donate: bool
) -> tuple[list[jax.Array], jax.Array]:
    outs, flags = [], []
    for start in range(0, len(leaves), MAX_LEAVES_PER_CALL):
        group_outs, group_flag = _launch(
            leaves[start : start + MAX_LEAVES_PER_CALL], inv, interpret=interpret, donate=donate
        )
        outs += group_outs
        flags.append(group_flag)
    return outs, functools.reduce(jnp.logical_or, flags)


def unscale_and_check(
    inv: jax.Array, leaves: Sequence[jax.Array], *, interpret: bool = False, donate: bool = False
) -> tuple[list[jax.Array], jax.Array]:
    """Unscale non-empty floating ``leaves`` by the float32 ``[factor, power_of_two]`` pair ``inv``; return
    them and ``found_inf``.

    ``donate=True`` aliases each output to its input, which saves memory only when the caller donates the
    gradients at its ``jit`` boundary (otherwise XLA copies them first).
    """
    return _grouped(leaves, inv, interpret=interpret, donate=donate)


def check(leaves: Sequence[jax.Array], *, interpret: bool = False) -> jax.Array:
    """``found_inf`` of non-empty floating ``leaves``: one read of each, nothing written (the scaler's check,
    whose unscale XLA fuses into the optimizer)."""
    return _grouped(leaves, None, interpret=interpret, donate=False)[1]
