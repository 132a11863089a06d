"""A cast that stays on its operand's shard: ``cast_on_shard``, one primitive.

XLA's SPMD partitioner chooses where to gather a sharded value that a matmul needs whole. A float32 parameter
cast to bfloat16 for the matmul can be gathered before the cast (float32 bytes) or after it (bfloat16 bytes);
Shardy's propagation decides, and a sharding its readers ask for (a replicating constraint, a matmul's) flows back
through an elementwise cast to its operand: then the float32 value is gathered and the gathered copy cast (jax#23543).
torch FSDP2 casts each shard to ``param_dtype`` and gathers the result, by construction.

``cast_on_shard(x, dtype)`` is ``convert_element_type`` whose result passes through a Shardy propagation barrier that
lets shardings flow forward only: the cast's sharding comes from its operand, never from its readers, so the cast
runs on whatever shard the operand has and any gather the readers need comes after it, in ``dtype``. The barrier is
gone once shardings are propagated (it costs nothing at run time). Outside a partitioned program (one device,
pmap's replicas) and under the GSPMD partitioner it is a plain convert. Differentiated as a cast: its transpose is a
plain ``convert_element_type`` back, which leaves where the gradient is reduced to the matmul's own rule.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax._src import config, dispatch
from jax._src.interpreters import ad, batching, mlir
from jax._src.lib.mlir.dialects import sdy
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext
from jax.extend import core as jcore

_CAST_ON_SHARD = jcore.Primitive("cast_on_shard")


def cast_on_shard(x: Any, dtype: Any) -> Any:
    """``x`` converted to ``dtype`` on the shard it has: a gather of the result is a gather in ``dtype``."""
    return _CAST_ON_SHARD.bind(x, new_dtype=np.dtype(dtype))


def _abstract_eval(x, *, new_dtype):
    return x.update(dtype=new_dtype, weak_type=False)


def _transpose(ct, x, *, new_dtype):
    return [jax.lax.convert_element_type(ct, x.aval.dtype)]


def _partitioned(ctx) -> bool:
    """Whether Shardy partitions this program over more than one device (jit, shard_map's auto axes)."""
    axis_context = ctx.module_context.axis_context
    if not config.use_shardy_partitioner.value:
        return False
    if isinstance(axis_context, ShardingContext):  # jit
        return axis_context.num_devices > 1
    return isinstance(axis_context, SPMDAxisContext)  # inside a shard_map


def _lower(ctx, x, *, new_dtype):
    (out,) = mlir.lower_fun(lambda v: jax.lax.convert_element_type(v, new_dtype), multiple_results=False)(ctx, x)
    if _partitioned(ctx):
        out = sdy.propagation_barrier(out, sdy.PropagationDirection.FORWARD)
    return [out]


_CAST_ON_SHARD.def_impl(lambda x, *, new_dtype: dispatch.apply_primitive(_CAST_ON_SHARD, x, new_dtype=new_dtype))
_CAST_ON_SHARD.def_abstract_eval(_abstract_eval)
ad.deflinear2(_CAST_ON_SHARD, _transpose)
batching.defvectorized(_CAST_ON_SHARD)
# Not cacheable: one op and its barrier, lowered in place at each cast rather than as a function every cast calls.
mlir.register_lowering(_CAST_ON_SHARD, _lower, cacheable=False)
