"""Regions: which mode and policy govern an equation, from its name-stack path.

A path is the chain of name scopes, flax module names and jit-wrapped function names that
enclose an equation. Policy rules match path components; nested ``jamp.autocast`` calls leave a
marker scope in the path. Walking the components from outermost to innermost and letting each
match override the last gives "innermost wins".
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from typing import Any, NamedTuple

from jamp.casting import oplists
from jamp.casting.policy import AUTOCAST, COMPUTE, FLOAT32_OUTPUT, NATIVE, OFF, Policy

F32, LOWER, PROMOTE, PASS, DEFAULT, LINALG = (
    oplists.FLOAT32,
    oplists.LOWER,
    oplists.PROMOTE,
    oplists.PASSTHROUGH,
    oplists.DEFAULT,
    oplists.LINALG,
)
# The leaf rule that lowers a matmul's inputs but keeps its float32 result (not a category of its own).
LOWER_F32_OUT = "lower_float32_output"

# mode -> category -> the leaf rule that runs. Linear algebra never sees a low dtype, whatever
# the region asks for; "off" is the original program.
EFFECTIVE_RULE: dict[str, dict[str, str]] = {
    AUTOCAST: {LOWER: LOWER, F32: F32, LINALG: F32, PROMOTE: PROMOTE, PASS: PASS, DEFAULT: DEFAULT},
    F32: {LOWER: F32, F32: F32, LINALG: F32, PROMOTE: F32, PASS: F32, DEFAULT: DEFAULT},
    FLOAT32_OUTPUT: {LOWER: LOWER_F32_OUT, F32: F32, LINALG: F32, PROMOTE: PROMOTE, PASS: PASS, DEFAULT: DEFAULT},
    COMPUTE: {LOWER: LOWER, F32: LOWER, LINALG: F32, PROMOTE: LOWER, PASS: LOWER, DEFAULT: DEFAULT},
    NATIVE: {LOWER: PROMOTE, F32: PROMOTE, LINALG: F32, PROMOTE: PROMOTE, PASS: PASS, DEFAULT: DEFAULT},
    OFF: {LOWER: DEFAULT, F32: DEFAULT, LINALG: DEFAULT, PROMOTE: DEFAULT, PASS: DEFAULT, DEFAULT: DEFAULT},
}


class Region(NamedTuple):
    """What a nested ``jamp.autocast`` asks for: a mode, and a policy or dtype if it changes them."""

    mode: str
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
def resolve(policy: Policy, mode: str, path: tuple[str, ...], comps: tuple[str, ...]) -> tuple[Policy, str]:
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
