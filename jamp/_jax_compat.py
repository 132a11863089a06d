"""Everything jamp needs from JAX internals, in one place.

jaxpr internals (primitive names, parameter names, where helpers live) change between JAX
releases. pyproject.toml pins the tested range; when it moves, this module is what changes.
Checked against jax 0.10.2.
"""

from __future__ import annotations

from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe
from jax._src.tree_util import FlatTree
from jax._src.util import weakref_lru_cache
from jax.extend import core as jcore
from jax.extend import linear_util as lu

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
Literal = jcore.Literal
Var = jcore.Var
jaxpr_as_fun = jcore.jaxpr_as_fun
jaxprs_in_params = jcore.jaxprs_in_params
wrap_init = lu.wrap_init
convert_constvars_jaxpr = pe.convert_constvars_jaxpr

# Primitive names (``eqn.primitive.name``) of the higher-order primitives jamp rewrites.
JIT = "jit"
CLOSED_CALL = "closed_call"
REMAT = "remat2"
SCAN = "scan"
WHILE = "while"
COND = "cond"
CUSTOM_JVP = "custom_jvp_call"
CUSTOM_VJP = "custom_vjp_call"
SHARD_MAP = "shard_map"

# Parameter names of those primitives (jax 0.10.2).
JIT_JAXPR = "jaxpr"            # ClosedJaxpr
JIT_NAME = "name"
CALL_JAXPR = "call_jaxpr"      # closed_call, custom_jvp_call, custom_vjp_call: ClosedJaxpr
REMAT_JAXPR = "jaxpr"          # open Jaxpr, no consts
SCAN_JAXPR = "jaxpr"           # ClosedJaxpr
WHILE_COND = "cond_jaxpr"      # ClosedJaxpr
WHILE_BODY = "body_jaxpr"      # ClosedJaxpr
COND_BRANCHES = "branches"     # tuple[ClosedJaxpr]
JVP_THUNK = "jvp_jaxpr_fun"    # WrappedFun: (*zeros) -> (Jaxpr, consts, out_zeros)
NUM_CONSTS = "num_consts"
FWD_THUNK = "fwd_jaxpr_thunk"  # WrappedFun: (*nonzeros) -> (Jaxpr, consts)
BWD = "bwd"                    # WrappedFun: python bwd rule, flat
SHARD_MAP_JAXPR = "jaxpr"      # open Jaxpr with per-shard avals
SHARD_MAP_OUT_SPECS = "out_specs"


def user_context(eqn):
    """The source-info context ``jax.core.eval_jaxpr`` binds each equation under."""
    return source_info_util.user_context(
        eqn.source_info.traceback,
        name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack,
    )


def name_stack_str(eqn) -> str:
    return str(eqn.source_info.name_stack)


def source_location(eqn) -> str:
    """'file.py:12 (fn)' of the user code that created ``eqn``, or '' when unknown."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})" if frame else ""


def is_symbolic_zero(x) -> bool:
    """True for the ``Zero`` placeholders a custom_vjp bwd rule may return."""
    from jax._src.ad_util import Zero

    return isinstance(x, Zero)


def shard_map_body(out_specs, body):
    """Wrap ``body(*args) -> list`` into the subfun form ``shard_map_p.bind`` expects."""

    def subfun(*args):
        return FlatTree.flatten(body(*args)).with_aux(out_specs)

    return subfun


__all__ = [
    "ClosedJaxpr", "Jaxpr", "Literal", "Var", "convert_constvars_jaxpr", "jaxpr_as_fun",
    "jaxprs_in_params", "weakref_lru_cache", "wrap_init", "user_context", "name_stack_str", "source_location",
    "is_symbolic_zero", "shard_map_body",
]
