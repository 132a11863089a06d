"""The parameters of scan, while and shard_map equations that jamp binds with more operands than they were
recorded with (the tools' shadows and reports, :mod:`jamp.tools.entering`): part of
:mod:`jamp._jax_compat`, which re-exports every name here; chosen by feature detection as there."""

from __future__ import annotations

import jax
from jax.extend import core as jcore

WHILE_COND_NCONSTS = "cond_nconsts"
WHILE_BODY_NCONSTS = "body_nconsts"
SHARD_MAP_IN_SPECS = "in_specs"


def scan_sizes(params: dict) -> tuple[int, int]:
    """(consts, carry): how many of a scan equation's operands are loop constants and how many its carry."""
    if "ft_in" in params:  # jax >= 0.11: flat trees of the operand groups
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def scan_params(params: dict, jaxpr: jcore.ClosedJaxpr, consts: int, carry: int, xs: int) -> dict:
    """``params`` of a scan that binds ``jaxpr`` on ``consts`` constants, ``carry`` carried values and ``xs``
    scanned arrays."""
    ys = len(jaxpr.out_avals) - carry
    if "ft_in" not in params:  # jax 0.10
        return {**params, "jaxpr": jaxpr, "num_consts": consts, "num_carry": carry}
    from jax._src import flattree as ft

    ft_in = ft.pack((ft.nones(consts), ft.nones(carry), ft.nones(xs)))
    return {**params, "jaxpr": jaxpr, "ft_in": ft_in, "ft_out": ft.pack((ft.nones(carry), ft.nones(ys)))}


def varying_like(x, aval):
    """``x`` (made from constants) varying over the manual mesh axes ``aval`` varies over inside a shard_map
    body, so that a loop carry or branch output keeps one type (the axes are ``aval.mat.varying``)."""
    axes = tuple(sorted(getattr(getattr(aval, "mat", None), "varying", ())))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def shard_map_manual_axes(params: dict) -> tuple[str, ...]:
    """The mesh axes a shard_map equation's body is manual over, in the mesh's order."""
    manual = params["newly_manual_axes"]
    return tuple(a for a in params["mesh"].axis_names if a in manual)


__all__ = [
    "SHARD_MAP_IN_SPECS",
    "WHILE_BODY_NCONSTS",
    "WHILE_COND_NCONSTS",
    "scan_params",
    "scan_sizes",
    "shard_map_manual_axes",
    "varying_like",
]
