"""Regions: which mode and policy govern an equation, from its name-stack path.

A path is the chain of name scopes, flax module names and jit-wrapped function names that
enclose an equation. Policy rules match path components; nested ``jamp.autocast`` calls leave a
marker scope in the path. Walking the components from outermost to innermost and letting each
match override the last gives "innermost wins".
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
import threading
from typing import Any, NamedTuple

from jamp.casting.oplists import Category
from jamp.casting.policy import Mode, Policy


class LeafRule(enum.StrEnum):
    """The interpreter's rules for first-order primitives (:mod:`jamp.casting.rules.leaf`), by name."""

    LOWER = "lower"  # floating inputs to the compute dtype
    LOWER_FLOAT32_OUTPUT = "lower_float32_output"  # as LOWER, but a matmul keeps its float32 result
    FLOAT32 = "float32"  # low-precision inputs up to float32
    PROMOTE = "promote"  # inputs to the widest
    PASSTHROUGH = "passthrough"  # as they arrive
    DEFAULT = "default"  # as the jaxpr recorded them


_C, _R = Category, LeafRule
# mode -> category -> the leaf rule that runs. Linear algebra never sees a low dtype, whatever
# the region asks for; "off" is the original program.
EFFECTIVE_RULE: dict[Mode, dict[Category, LeafRule]] = {
    Mode.AUTOCAST: {
        _C.LOWER: _R.LOWER, _C.FLOAT32: _R.FLOAT32, _C.LINALG: _R.FLOAT32,
        _C.PROMOTE: _R.PROMOTE, _C.PASSTHROUGH: _R.PASSTHROUGH, _C.DEFAULT: _R.DEFAULT,
    },
    Mode.FLOAT32: {
        _C.LOWER: _R.FLOAT32, _C.FLOAT32: _R.FLOAT32, _C.LINALG: _R.FLOAT32,
        _C.PROMOTE: _R.FLOAT32, _C.PASSTHROUGH: _R.FLOAT32, _C.DEFAULT: _R.DEFAULT,
    },
    Mode.FLOAT32_OUTPUT: {
        _C.LOWER: _R.LOWER_FLOAT32_OUTPUT, _C.FLOAT32: _R.FLOAT32, _C.LINALG: _R.FLOAT32,
        _C.PROMOTE: _R.PROMOTE, _C.PASSTHROUGH: _R.PASSTHROUGH, _C.DEFAULT: _R.DEFAULT,
    },
    Mode.COMPUTE: {
        _C.LOWER: _R.LOWER, _C.FLOAT32: _R.LOWER, _C.LINALG: _R.FLOAT32,
        _C.PROMOTE: _R.LOWER, _C.PASSTHROUGH: _R.LOWER, _C.DEFAULT: _R.DEFAULT,
    },
    Mode.NATIVE: {
        _C.LOWER: _R.PROMOTE, _C.FLOAT32: _R.PROMOTE, _C.LINALG: _R.FLOAT32,
        _C.PROMOTE: _R.PROMOTE, _C.PASSTHROUGH: _R.PASSTHROUGH, _C.DEFAULT: _R.DEFAULT,
    },
    Mode.OFF: dict.fromkeys(Category, _R.DEFAULT),
}  # fmt: skip


class Region(NamedTuple):
    """What a nested ``jamp.autocast`` asks for: a mode, and a policy or dtype if it changes them."""

    mode: Mode
    policy: Policy | None = None
    dtype: Any = None


MARKER_PREFIX = "jamp_region_"
_markers: dict[str, Region] = {}
_marker_of: dict[Region, str] = {}
_marker_ids = itertools.count()
_marker_lock = threading.Lock()


def marker_for(region: Region) -> str:
    """A name-scope name standing for ``region``; equal regions share a marker."""
    with _marker_lock:
        if region not in _marker_of:
            name = f"{MARKER_PREFIX}{next(_marker_ids)}"
            _marker_of[region], _markers[name] = name, region
        return _marker_of[region]


_TRANSFORM_WRAPPER = re.compile(r"[A-Za-z_][\w]*\(|\)")


@functools.lru_cache(maxsize=4096)
def components(name_stack: str) -> tuple[str, ...]:
    """'transpose(jvp(M))/Block_0' -> ('M', 'Block_0'): transformation wrappers are dropped."""
    return tuple(c for c in _TRANSFORM_WRAPPER.sub("", name_stack).split("/") if c)


@functools.lru_cache(maxsize=8192)
def resolve(policy: Policy, mode: Mode, path: tuple[str, ...], comps: tuple[str, ...]) -> tuple[Policy, Mode]:
    """The (policy, mode) in force after descending from ``path`` through ``comps``."""
    for depth in range(len(comps)):
        comp = comps[depth]
        region = _markers.get(comp)
        if region is not None:
            policy, mode = region.policy or policy, region.mode
            if region.dtype is not None:
                policy = policy.with_compute_dtype(region.dtype)
            continue
        matched = policy.match("/".join(path + comps[: depth + 1]), comp)
        if matched is not None:
            mode = matched
    return policy, mode
