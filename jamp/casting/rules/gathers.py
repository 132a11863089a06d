"""Gathers a program writes itself run on the compute dtype when only matmuls read what they gather.

FSDP written by hand gathers a float32 parameter (``all_gather`` in a shard_map or pmap, ``with_sharding_constraint``
or ``jax.sharding.reshard`` under jit) and then multiplies it: autocast would gather float32 and cast the gathered
value, twice the bytes torch FSDP2 sends (it casts each shard to ``param_dtype`` and gathers that). Where every
reader of the gathered value is a matmul that autocast runs in the compute dtype, the gather runs on the cast shard
instead (the same numbers: a gather moves elements, a cast rounds each one), a cast pinned to its shard
(:func:`jamp._jax_compat.cast_on_shard`): a replicating constraint would otherwise pull the cast's sharding back and
the partitioner gather the float32 value before it.

The gradient keeps its dtype: where ``reduce_dtype`` is wider than the compute dtype, the gather of the value as given
is bound too and stands for the gathered operand in the matmul (:mod:`jamp.casting.wide_cotangents`), which reads it
only for its tangent. So the parameter's cotangent is reduced across devices (the gather's transpose) in
``reduce_dtype``; in the forward program that gather has no reader and XLA removes it before partitioning.
"""

from __future__ import annotations

import numpy as np

from jamp import _jax_compat as jc
from jamp.casting import regions, wide_cotangents
from jamp.casting.call import Call, Context
from jamp.casting.dtypes import is_eligible
from jamp.casting.regions import LeafRule

GATHERS = ("all_gather", "all_gather_invariant", "sharding_constraint", "reshard")
# Rearranging ops between a gather and its matmuls (``x @ w.T``): they run on what the gather gave.
REARRANGING = ("transpose", "reshape", "squeeze", "expand_dims")
_LOWERED = (LeafRule.LOWER, LeafRule.LOWER_FLOAT32_OUTPUT)


def read_only_by_matmuls(jaxpr: jc.Jaxpr, ctx: Context, select_rule) -> frozenset:
    """The outputs of ``jaxpr``'s gathers that only matmuls read (directly or through ``REARRANGING`` ops), each run
    in the gather's compute dtype, whose gradient in that operand comes out in ``reduce_dtype`` (a ``dot_general``;
    a convolution only where ``reduce_dtype`` is the compute dtype)."""
    gathers = [e for e in jaxpr.eqns if e.primitive.name in GATHERS and len(e.outvars) == 1]
    if not gathers or ctx.policy.fp8:  # a float8 matmul casts its own operands, from float32
        return frozenset()
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jc.Var):
                readers.setdefault(v, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jc.Var)}

    def only_matmuls(v, dtype) -> bool:
        eqns = readers.get(v)
        return (
            bool(eqns)
            and v not in outputs
            and all(
                _lowered_matmul(e, _context(ctx, e), select_rule, dtype)
                or (e.primitive.name in REARRANGING and only_matmuls(e.outvars[0], dtype))
                for e in eqns
            )
        )

    return frozenset(g.outvars[0] for g in gathers if only_matmuls(g.outvars[0], _context(ctx, g).compute_dtype))


def _context(ctx: Context, eqn) -> Context:
    return ctx.descend(regions.components(jc.name_stack_str(eqn)))


def _lowered_matmul(eqn, eqn_ctx: Context, select_rule, dtype) -> bool:
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated") or eqn_ctx.compute_dtype != dtype:
        return False
    if not all(np.issubdtype(v.aval.dtype, np.floating) and is_eligible(v.aval.dtype) for v in eqn.invars):
        return False  # the lower rule falls back to the recorded dtypes
    if select_rule(eqn, eqn_ctx)[1] not in _LOWERED:
        return False
    if name == "dot_general":
        return wide_cotangents.applies(eqn.params)
    return np.dtype(eqn_ctx.policy.reduce_dtype).itemsize <= dtype.itemsize


def gather(call: Call):
    """A gather whose output only matmuls read (``read_only_by_matmuls``) runs on the compute dtype; any other, on
    what arrives."""
    x, dtype = call.invals[0], call.ctx.compute_dtype
    if call.eqn.outvars[0] not in call.env.gathered_for_matmuls or np.dtype(x.dtype).itemsize <= dtype.itemsize:
        return call.bind()
    wide = None
    if wide_cotangents.widens(x.dtype, dtype, call.ctx.policy.reduce_dtype):
        # what the matmul differentiates; a constraint that leaves the type as it is (Auto sharding) is not bound
        # twice: a constraint without readers stays in the program, a gather does not
        wide = x if _keeps_type(call.eqn) else call.bind()
    low = call.bind([jc.cast_on_shard(x, dtype)])  # pinned to its shard: the partitioner gathers after the cast
    if wide is not None:
        call.env.stands_for(low, wide)
    return low


def _keeps_type(eqn) -> bool:
    """Whether the gather's output has its input's shape and sharding type (a constraint under Auto sharding)."""
    before, after = eqn.invars[0].aval, eqn.outvars[0].aval
    return before.shape == after.shape and before.sharding.spec == after.sharding.spec


def rearrange(call: Call):
    """A rearranging op; on a gathered value that stands for a wider one, that one is rearranged too (for the
    matmul's tangent)."""
    wide = call.env.wide_origin(call.invals[0])
    if wide is call.invals[0]:
        return call.bind()
    wide_out = call.bind([wide, *call.invals[1:]])
    out = call.bind()
    call.env.stands_for(out, wide_out)
    return out
