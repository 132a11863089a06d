"""Shared test utilities: walk jaxprs recursively and read the dtypes of every equation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
from jax.extend import core as jcore


def eqns(closed_or_jaxpr):
    """Every equation, recursing into sub-jaxprs (jit, scan, cond, remat, custom_*, shard_map)."""
    jaxpr = getattr(closed_or_jaxpr, "jaxpr", closed_or_jaxpr)
    for e in jaxpr.eqns:
        yield e
        for sub in jcore.jaxprs_in_params(e.params):
            yield from eqns(sub)


def dtypes_of(fun, *args, primitive="dot_general", **kwargs):
    """[(input dtypes..., output dtype)] for every ``primitive`` in ``make_jaxpr(fun)(*args)``."""
    closed = jax.make_jaxpr(fun, **kwargs)(*args)
    return [
        tuple(str(v.aval.dtype) for v in e.invars) + (str(e.outvars[0].aval.dtype),)
        for e in eqns(closed)
        if e.primitive.name == primitive
    ]


def count(fun, *args, primitive):
    return sum(e.primitive.name == primitive for e in eqns(jax.make_jaxpr(fun)(*args)))


def run_subprocess(code: str, *, devices: int = 8, env: dict | None = None, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter with ``devices`` host CPU devices; return its stdout."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    full_env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=root,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
