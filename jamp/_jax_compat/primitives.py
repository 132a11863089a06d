"""The higher-order primitives jamp rewrites: their names, the names of their parameters, and what jamp reads
of them (accessors: rules ask ``jit_name(eqn)``, never ``eqn.params[...]``). Part of :mod:`jamp._jax_compat`,
which re-exports every name here; tests/casting/test_oplists.py names the primitive and parameter when a new
release moves one."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jax.extend import core as jcore
from jax.extend import linear_util as lu

from jamp._jax_compat.loops import SHARD_MAP_IN_SPECS, WHILE_BODY_NCONSTS, WHILE_COND_NCONSTS, shard_map_manual_axes

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

# Parameter names of those primitives (unchanged from jax 0.10.2 through 0.12.x).
JIT_JAXPR = "jaxpr"  # ClosedJaxpr
JIT_NAME = "name"
CALL_JAXPR = "call_jaxpr"  # closed_call, custom_jvp_call, custom_vjp_call: ClosedJaxpr
REMAT_JAXPR = "jaxpr"  # open Jaxpr, no consts
SCAN_JAXPR = "jaxpr"  # ClosedJaxpr
SCAN_LENGTH = "length"
SCAN_REVERSE = "reverse"
WHILE_COND = "cond_jaxpr"  # ClosedJaxpr
WHILE_BODY = "body_jaxpr"  # ClosedJaxpr
COND_BRANCHES = "branches"  # tuple[ClosedJaxpr]
JVP_THUNK = "jvp_jaxpr_fun"  # WrappedFun: (*zeros) -> (Jaxpr, consts, out_zeros)
NUM_CONSTS = "num_consts"
FWD_THUNK = "fwd_jaxpr_thunk"  # WrappedFun: (*nonzeros) -> (Jaxpr, consts)
BWD = "bwd"  # WrappedFun: python bwd rule, flat
SHARD_MAP_JAXPR = "jaxpr"  # open Jaxpr with per-shard avals
SHARD_MAP_OUT_SPECS = "out_specs"
SHARD_MAP_BODY = "subfuns"  # what get_bind_params makes of the jaxpr: (the body as a WrappedFun,)
SHARD_MAP_DEBUG_INFO = "debug_info"


def jit_name(eqn: jcore.JaxprEqn) -> str:
    """The name of the function a ``jit`` equation calls."""
    return eqn.params[JIT_NAME]


def jit_jaxpr(eqn: jcore.JaxprEqn) -> jcore.ClosedJaxpr:
    return eqn.params[JIT_JAXPR]


def call_jaxpr(eqn: jcore.JaxprEqn) -> jcore.ClosedJaxpr:
    """The body of a ``closed_call``, ``custom_jvp_call`` or ``custom_vjp_call``."""
    return eqn.params[CALL_JAXPR]


def remat_jaxpr(eqn: jcore.JaxprEqn) -> jcore.Jaxpr:
    """A checkpoint's body, an open jaxpr."""
    return eqn.params[REMAT_JAXPR]


def call_body(eqn: jcore.JaxprEqn) -> jcore.Jaxpr | None:
    """The open jaxpr a ``jit``, ``custom_jvp_call`` or checkpoint runs whole, else None."""
    name = eqn.primitive.name
    if name == JIT:
        return jit_jaxpr(eqn).jaxpr
    if name == CUSTOM_JVP:
        return call_jaxpr(eqn).jaxpr
    return remat_jaxpr(eqn) if name == REMAT else None


def scan_jaxpr(eqn: jcore.JaxprEqn) -> jcore.ClosedJaxpr:
    return eqn.params[SCAN_JAXPR]


def scan_length(eqn: jcore.JaxprEqn) -> int:
    return eqn.params[SCAN_LENGTH]


def scan_reverse(eqn: jcore.JaxprEqn) -> bool:
    """Whether the scan runs from its last element."""
    return eqn.params[SCAN_REVERSE]


def while_parts(eqn: jcore.JaxprEqn) -> tuple[jcore.ClosedJaxpr, jcore.ClosedJaxpr, int, int]:
    """(condition, body, the condition's constants, the body's constants) of a ``while`` equation."""
    p = eqn.params
    return p[WHILE_COND], p[WHILE_BODY], p[WHILE_COND_NCONSTS], p[WHILE_BODY_NCONSTS]


def cond_branches(eqn: jcore.JaxprEqn) -> tuple[jcore.ClosedJaxpr, ...]:
    return eqn.params[COND_BRANCHES]


def custom_jvp_parts(eqn: jcore.JaxprEqn) -> tuple[int, lu.WrappedFun]:
    """(how many of its operands are constants, the thunk that builds its JVP jaxpr) of a ``custom_jvp_call``."""
    return eqn.params[NUM_CONSTS], eqn.params[JVP_THUNK]


def custom_vjp_parts(eqn: jcore.JaxprEqn) -> tuple[lu.WrappedFun, lu.WrappedFun]:
    """(the fwd thunk, the flat bwd rule) of a ``custom_vjp_call``."""
    return eqn.params[FWD_THUNK], eqn.params[BWD]


def call_thunk(fun: lu.WrappedFun, *args: Any) -> Any:
    """What one of those thunks or rules returns on ``args``."""
    return fun.call_wrapped(*args)


def wrap_like(fun: Callable, original: lu.WrappedFun) -> lu.WrappedFun:
    """``fun`` wrapped as the thunk or rule ``original`` is (its debug information kept)."""
    return lu.wrap_init(fun, debug_info=original.debug_info)


def shard_map_jaxpr(eqn: jcore.JaxprEqn) -> jcore.Jaxpr:
    return eqn.params[SHARD_MAP_JAXPR]


def shard_map_out_specs(eqn: jcore.JaxprEqn) -> tuple:
    return eqn.params[SHARD_MAP_OUT_SPECS]


def shard_map_devices(eqn: jcore.JaxprEqn) -> int:
    """How many devices a shard_map equation's body runs on (its manual mesh axes)."""
    mesh = eqn.params["mesh"]
    return math.prod(mesh.shape[a] for a in shard_map_manual_axes(eqn.params))


def shard_map_params(eqn: jcore.JaxprEqn, subfun: Callable, more_operands: int = 0) -> dict:
    """The bind parameters of ``eqn`` with ``subfun`` (made by ``shard_map_body``) as its body; ``more_operands``
    operands after its own, each under the in_spec of the one as far before it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    params[SHARD_MAP_BODY] = (subfun,)
    if more_operands:
        in_specs = params[SHARD_MAP_IN_SPECS]
        params[SHARD_MAP_IN_SPECS] = (*in_specs, *in_specs[:more_operands])
        params[SHARD_MAP_DEBUG_INFO] = params[SHARD_MAP_DEBUG_INFO].with_unknown_names()  # not the function's own
    return params


__all__ = [
    "BWD",
    "CALL_JAXPR",
    "CLOSED_CALL",
    "COND",
    "COND_BRANCHES",
    "CUSTOM_JVP",
    "CUSTOM_VJP",
    "FWD_THUNK",
    "JIT",
    "JIT_JAXPR",
    "JIT_NAME",
    "JVP_THUNK",
    "NUM_CONSTS",
    "REMAT",
    "REMAT_JAXPR",
    "SCAN",
    "SCAN_JAXPR",
    "SCAN_LENGTH",
    "SCAN_REVERSE",
    "SHARD_MAP",
    "SHARD_MAP_BODY",
    "SHARD_MAP_DEBUG_INFO",
    "SHARD_MAP_JAXPR",
    "SHARD_MAP_OUT_SPECS",
    "WHILE",
    "WHILE_BODY",
    "WHILE_COND",
    "call_body",
    "call_jaxpr",
    "call_thunk",
    "cond_branches",
    "custom_jvp_parts",
    "custom_vjp_parts",
    "jit_jaxpr",
    "jit_name",
    "remat_jaxpr",
    "scan_jaxpr",
    "scan_length",
    "scan_reverse",
    "shard_map_devices",
    "shard_map_jaxpr",
    "shard_map_out_specs",
    "shard_map_params",
    "while_parts",
    "wrap_like",
]
