"""``jamp.find_overflow``: run the autocast program beside the float32 program and report the first op
whose low-precision result is inf/NaN (or underflows to zero) where float32 is fine.

Both programs are traced into one jitted function that returns, for every compared op, the counts of
its bad elements, so a call costs one compile and one run of about the two forward passes plus one
reduction per op (evaluating op by op eagerly cost a dispatch and a host round trip per op). The
compiled comparison is cached per argument signature.

The comparison is an observer of autocast's own interpreter (:mod:`jamp.tools.comparison`): the float32
program runs beside the autocast program through the same rules, so both enter every body autocast
enters (scan, while and cond bodies, shard_map bodies, jit, checkpoint, custom derivatives,
``jamp.lower_precision`` calls). Counts made inside a loop leave it in its carry (the first iteration
that went bad), a cond's from every branch, a shard_map's per device.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting.autocast import autocast
from jamp.casting.call import Context
from jamp.tools.bodies import observed
from jamp.tools.comparison import Comparison, Site
from jamp.tools.observation import COND, SCAN, SHARD_MAP, WHILE, Frame
from jamp.tools.sources import short_source

_CACHE_SIZE = 8  # argument signatures a find_overflow(...) function keeps compiled, oldest dropped first
# Each op rounds to its own dtype, as when it runs alone: XLA may otherwise keep a float16 value in
# float32 between fused ops and hide an overflow.
_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# XLA:CPU compiles every kernel through LLVM, and the comparison adds about a kernel per op: this
# cheaper pipeline compiled a small transformer's training step a third faster and ran it as fast
# (level 0 compiled faster still but ran 4x slower).
_CPU_COMPILER_OPTIONS = {
    **_COMPILER_OPTIONS,
    "xla_backend_optimization_level": 1,
    "xla_llvm_disable_expensive_passes": True,
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first op where autocast broke what float32 computes: what :func:`jamp.find_overflow` returns.

    ``str(finding)`` is one line: the kind, the primitive, the user's line, how many elements, and the
    largest magnitude float32 computes there.

    Attributes:
        kind: "overflow" (inf/NaN where float32 is finite) or "underflow" (flushed to zero where float32 is
            not).
        primitive: the primitive's name ("dot_general").
        source: the user's line that made the op, as ``file:line (function)``.
        path: the name scopes, flax module path and jit names around it, joined by "/" ("" at the top).
        op_index: the op's position in evaluation order (sub-jaxprs included), from 1.
        input_dtypes: the dtypes of its inputs under autocast.
        output_dtype: the dtype of the bad output.
        bad_elements: how many elements of that output are bad.
        total_elements: how many elements it has.
        float32_max_abs: the largest finite ``|value|`` float32 computes there: compare it with the dtype's
            range (65504 for float16).
        iteration: per enclosing scan or while loop, outermost first: the index along the scanned axis (a
            layer of a scanned model) or the while loop's iteration.
        branch: per enclosing cond, the branch that ran.
        device: per enclosing shard_map, the device (its index along the map's manual axes).
        scope: the loops, branches and shard_maps around it, in words.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> check = jamp.find_overflow(lambda a: a @ a, device_type="gpu")
        >>> finding = check(jnp.full((2, 2), 300.0))
        >>> finding.kind, finding.primitive, finding.output_dtype
        ('overflow', 'dot_general', 'float16')
        >>> finding.bad_elements, finding.total_elements
        (4, 4)
        >>> finding.float32_max_abs  # 2 * 300 * 300
        180000.0
    """

    kind: str  # "overflow" (inf/NaN) or "underflow" (flushed to zero)
    primitive: str
    source: str  # user file:line (function)
    path: str  # name scopes / flax module path / jit names
    op_index: int  # position in evaluation order (sub-jaxprs included)
    input_dtypes: tuple
    output_dtype: str
    bad_elements: int
    total_elements: int
    float32_max_abs: float  # largest |value| float32 computes there: compare with the dtype's range
    # per enclosing scan or while loop, outermost first: the index along the scanned axis (a layer of a
    # scanned model), the while loop's iteration
    iteration: tuple[int, ...] = ()
    branch: tuple[int, ...] = ()  # per enclosing cond: the branch that ran
    device: tuple[int, ...] = ()  # per enclosing shard_map: the device (index along its manual axes)
    scope: str = ""  # the loops, branches and shard_maps around it, in words

    def __str__(self) -> str:
        return (
            f"{self.kind} in {self.primitive} (op #{self.op_index}) at {short_source(self.source) or '?'} "
            f"[{self.path or '<top>'}]{', ' + self.scope if self.scope else ''}: {self.bad_elements}/"
            f"{self.total_elements} elements of its {self.output_dtype} output, inputs "
            f"{', '.join(self.input_dtypes)}; float32 max |x| = {self.float32_max_abs:.4g}"
        )


# Per scope with a level in a report: the Finding field the level fills, and how it reads. A cond has none
# (its branch is the site's own), a shard_map's devices run at once (they order only among equals).
_LEVELS = {
    SCAN: ("iteration", lambda s, i: f"iteration {i} of scan (length {s.count}{', reversed' if s.reverse else ''})"),
    WHILE: ("iteration", lambda s, i: f"iteration {i} of while loop"),
    SHARD_MAP: ("device", lambda s, i: f"device {i} of shard_map"),
}


def _where(site: Site, levels) -> tuple[tuple, dict]:
    """(order key, Finding fields) of a site's report with these levels: a loop body's reports order by
    iteration, then by op; among equals the lowest device comes first."""
    key, devices, fields, words = [], [], {"iteration": [], "branch": [], "device": []}, []
    found = iter(levels)
    for scope in site.scope:
        if scope.kind == COND:
            fields["branch"].append(scope.index)
            words.append(f"branch {scope.index} of cond")
            continue
        level = int(next(found))  # a reversed scan's step counts from its last element
        index = scope.count - 1 - level if scope.reverse else level
        field, say = _LEVELS[scope.kind]
        fields[field].append(index)
        words.append(say(scope, index))
        parallel = scope.kind == SHARD_MAP
        key += [scope.position, 0 if parallel else level]
        devices += [level] if parallel else []
    return (*key, site.op_index, *devices), {**{k: tuple(v) for k, v in fields.items()}, "scope": ", ".join(words)}


def _first_finding(sites: list[Site], reports: np.ndarray, payload: int) -> Finding | None:
    """The report that found something first in evaluation order, as a Finding."""
    best, offset = None, 0
    for site in sites:
        depth = len(site.levels)
        row = reports[offset : offset + 1 + depth + payload]
        offset += len(row)
        if not row[0]:
            continue
        key, where = _where(site, row[1 : 1 + depth])
        if best is None or key < best[0]:
            best = (key, site, where, row[1 + depth :])
    if best is None:
        return None
    _, site, where, (over, under, _, top) = best
    return Finding(
        kind="overflow" if over else "underflow",
        primitive=site.primitive,
        source=site.source,
        path=site.path,
        op_index=site.op_index,
        input_dtypes=site.input_dtypes,
        output_dtype=site.output_dtype,
        bad_elements=int(over or under),
        total_elements=site.total_elements,
        float32_max_abs=float(np.int32(top).view(np.float32)),
        **where,
    )


def _compile(closed: jc.ClosedJaxpr, dynamic: list, ctx: Context, min_underflow: float) -> tuple[list, Callable]:
    """The compared sites and the compiled program returning all their reports, concatenated."""
    comparison = Comparison(min_underflow)
    sites: list[Site] = []

    def side_by_side(*dynamic):
        frame = Frame(comparison).child(closed.jaxpr, closed.consts, list(dynamic))
        observed(closed.jaxpr, closed.consts, dynamic, ctx, frame)
        sites[:] = [site for site, _ in frame.reports]
        return jnp.concatenate([r for _, r in frame.reports]) if sites else jnp.zeros((0,), jnp.int32)

    options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else _COMPILER_OPTIONS
    return sites, jax.jit(side_by_side).trace(*dynamic).lower().compile(options)


def find_overflow(
    fun: Callable, *, min_underflow: float = 0.01, **autocast_kwargs: Any
) -> Callable[..., Finding | None]:
    """The first op of ``jamp.autocast(fun)`` whose low-precision result breaks what float32 computes.

    The autocast program and the float32 program run side by side, op by op in lockstep, in one compiled
    program: inside jit, checkpoint, custom_jvp/custom_vjp and ``jamp.lower_precision`` bodies, every
    iteration of a scan or while loop (a model scanned over its layers), the branch a cond takes and a
    shard_map body on every device. An op is reported where its result is inf/NaN while float32's is
    finite, or (with ``min_underflow`` < 1) where it flushes at least that fraction of its nonzero values
    to zero; the first in evaluation order wins. The comparison is compiled once per argument signature
    and kept, so checking every N training steps costs one run each time. For a training step pass
    ``jax.value_and_grad(loss)`` to check the backward pass too. Each op rounds to its own dtype, as when
    it runs alone.

    Args:
        fun: the function to check, as given to :func:`jamp.autocast`.
        min_underflow: the fraction (in [0, 1]) of an op's nonzero float32 values that must flush to zero
            in float16/bfloat16 for an underflow to be reported; 1 reports overflows only.
        **autocast_kwargs: the options of :func:`jamp.autocast` (``dtype``, ``device_type``, ``policy``,
            ...), as the run to check has them.

    Returns:
        A function that takes ``fun``'s arguments and returns the first :class:`jamp.Finding` (with the scan
        or while iteration, cond branch and shard_map device it happened in), or None.

    Raises:
        ValueError: for a ``min_underflow`` outside [0, 1].

    Examples:
        >>> import jax, jax.numpy as jnp, jamp
        >>> check = jamp.find_overflow(lambda a: a @ a, device_type="gpu")
        >>> check(jnp.ones((2, 2))) is None  # nothing overflows
        True
        >>> check(jnp.full((2, 2), 300.0)).kind  # 2 * 300 * 300 > float16's 65504
        'overflow'
        >>> w = jnp.full((256, 256), 300.0)
        >>> layer = lambda h, s: (jnp.tanh(h @ (w * s)), None)
        >>> scales = jnp.array([1e-3, 1.0])
        >>> layers = lambda x: jax.lax.scan(layer, x, scales)[0]
        >>> finding = jamp.find_overflow(layers, device_type="gpu")(jnp.ones((4, 256)))
        >>> finding.primitive, finding.iteration  # the second layer of the scan
        ('dot_general', (1,))
    """
    if not 0 <= min_underflow <= 1:
        raise ValueError(f"min_underflow={min_underflow!r} must be in [0, 1] (1 disables underflow reports)")
    amp = autocast(fun, **autocast_kwargs)
    compiled: collections.OrderedDict = collections.OrderedDict()

    def run(*args, **kwargs) -> Finding | None:
        key, dynamic = amp.call_key(*args, **kwargs)
        entry = compiled.get(key) if key is not None else None
        if entry is None:
            closed, dynamic, ctx = amp.trace_original(*args, **kwargs)
            entry = _compile(closed, dynamic, ctx, min_underflow)
            if key is not None:
                compiled[key] = entry
                if len(compiled) > _CACHE_SIZE:
                    compiled.popitem(last=False)
        sites, executable = entry
        return _first_finding(sites, np.asarray(executable(*dynamic)), Comparison.payload)

    return run
