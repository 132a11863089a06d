"""The named axes a jaxpr communicates over: its collectives (psum, all_gather, ppermute, ...) and the
parameter that names their axes, per primitive; part of :mod:`jamp._jax_compat`."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

from jax.extend import core as jcore

# collective primitive -> the parameter that names its axes (a name or a tuple of names)
AXES_PARAM = {
    "psum": "axes",
    "pmax": "axes",
    "pmin": "axes",
    "psum_invariant": "axes",
    "all_gather": "axis_name",
    "all_gather_invariant": "axis_name",
    "ppermute": "axis_name",
    "reduce_scatter": "axis_name",
    "all_to_all": "axis_name",
}
# higher-order primitive -> the parameter naming the axes its body binds (collectives over them stay inside)
_BINDS_AXES = {"shard_map": "newly_manual_axes"}


def _jaxprs(value: Any) -> Iterator[jcore.Jaxpr]:
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs(item)


def _names(axes: Any) -> set[Hashable]:
    axes = axes if isinstance(axes, (tuple, list, frozenset, set)) else (axes,)
    return {a for a in axes if not isinstance(a, int)}  # ints: positional axes, not mapped names


def collective_axes(jaxpr: jcore.Jaxpr) -> set[Hashable]:
    """The named axes that ``jaxpr``'s collectives, its sub-jaxprs' included, reduce or exchange over, less those
    a shard_map inside it binds itself."""
    found: set[Hashable] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in AXES_PARAM:
            found |= _names(eqn.params.get(AXES_PARAM[name], ()))
        inner = {a for value in eqn.params.values() for sub in _jaxprs(value) for a in collective_axes(sub)}
        found |= inner - _names(eqn.params.get(_BINDS_AXES.get(name, ""), ()))
    return found
