"""Kernels a jitted step launches on the GPU, and the device time they take, from a ``jax.profiler`` trace.

Wall-clock time of a step includes the host's dispatch of every argument; on a GPU a 50-leaf step spends a
good part of a millisecond there. The trace gives what the device did: every kernel (and copy) with its
duration, grouped by the HLO op that launched it. Used by scaler_overhead.py and kernels.py; on a CPU it
returns None (XLA:CPU runs thunks on host threads, not kernels).
"""

from __future__ import annotations

import collections
import glob
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import jax


class KernelProfile(NamedTuple):
    """Per step: kernels launched, their summed device time, the span from the first kernel's start to the
    last one's end (gaps between launches included), and ``{hlo op: (launches, microseconds)}``."""

    launches: float
    device_ms: float
    span_ms: float
    by_op: dict[str, tuple[float, float]]

    def top(self, n: int = 8) -> str:
        ops = sorted(self.by_op.items(), key=lambda kv: -kv[1][1])[:n]
        return ", ".join(f"{op} x{count:g} {us:.0f}us" for op, (count, us) in ops)


def _stat(event, name: str):
    return next((value for key, value in event.stats if key == name), None)


def profile(run: Callable[[], None], steps: int = 10) -> KernelProfile | None:
    """Trace ``steps`` calls of ``run`` (one step each, blocking); None unless the default device is a GPU."""
    if jax.default_backend() != "gpu":
        return None
    from jax.profiler import ProfileData

    run()  # compiled and warm
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        for _ in range(steps):
            run()
    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    per_op: dict[str, list[float]] = collections.defaultdict(list)
    spans: dict[object, list[float]] = collections.defaultdict(lambda: [float("inf"), 0.0])
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                per_op[str(_stat(event, "hlo_op") or event.name)].append(event.duration_ns / 1e3)
                span = spans[_stat(event, "run_id")]
                span[0] = min(span[0], event.start_ns)
                span[1] = max(span[1], event.start_ns + event.duration_ns)
    by_op = {op: (len(us) / steps, sum(us) / steps) for op, us in per_op.items()}
    span_ms = statistics.median((end - start) / 1e6 for start, end in spans.values()) if spans else float("nan")
    return KernelProfile(
        launches=sum(c for c, _ in by_op.values()),
        device_ms=sum(us for _, us in by_op.values()) / 1e3,
        span_ms=span_ms,
        by_op=by_op,
    )


def median_ms(times_s: list[float]) -> float:
    return statistics.median(times_s) * 1e3
