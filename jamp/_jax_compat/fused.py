"""A function of arrays bound as one equation, as torch runs ``_amp_update_scale_`` as one kernel.

The scale rule is about 160 scalar integer operations (an exact double-precision product and its two roundings).
Bound as they are, every program that holds a scaler's update shows them all: ``jax.make_jaxpr(tx.update)``, a
debugger, every transformation of the update walks them. :func:`one_equation` makes such a function a primitive of
its own: one equation in the jaxpr, lowered by tracing the function (XLA compiles the same operations), batched by
evaluating it on stacked inputs, with a zero derivative (a loss scale is not differentiated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core
from jax._src.interpreters import ad, batching, mlir
from jax.extend import core as jcore


def one_equation(name: str, fun: Callable[..., Sequence[jax.Array]], out_dtypes: Sequence[Any]) -> Callable:
    """``fun`` bound as one equation of primitive ``name``.

    Args:
        name: the primitive's name, as the jaxpr shows it.
        fun: a function of arrays that share their leading dimensions (the first argument's shape; the others
            may add trailing ones) and returns one array of the first argument's shape per dtype in ``out_dtypes``,
            elementwise over those leading dimensions.
        out_dtypes: the dtypes of ``fun``'s outputs.

    Returns:
        A function of the same arguments that binds the primitive: evaluated, lowered and batched as ``fun``.
    """
    primitive = jcore.Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(lambda *args: list(fun(*args)))

    def abstract_eval(*avals):
        return [avals[0].update(dtype=dtype, weak_type=False) for dtype in out_dtypes]

    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, mlir.lower_fun(lambda *args: list(fun(*args)), multiple_results=True))

    def zero_tangents(primals, tangents):
        outs = primitive.bind(*primals)
        return outs, [ad.p2tz(out) for out in outs]

    ad.primitive_jvps[primitive] = zero_tangents

    def batch(args, dims):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        stacked = [
            jax.numpy.broadcast_to(x, (size, *x.shape)) if d is None else jax.numpy.moveaxis(x, d, 0)
            for x, d in zip(args, dims)
        ]
        return bind(*stacked), [0] * len(out_dtypes)

    batching.primitive_batchers[primitive] = batch

    def bind(*args):
        # the operands vary over the same manual axes, as jax.lax makes those of its own primitives
        return primitive.bind(*core.auto_insert_reshard(*map(jax.numpy.asarray, args)))

    return bind
