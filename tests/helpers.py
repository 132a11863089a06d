"""Shared test utilities: walk jaxprs recursively and read the dtypes of every equation."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
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


# jamp's matmuls whose wider operands' gradients come out in reduce_dtype, and their backward products of
# compute-dtype operands into a wider result (jamp._jax_compat.wide_tangents): dot_generals; its casts of a
# jaxpr's inputs that stay on their shard (jamp._jax_compat.shard_casts): convert_element_types
ALSO = {"dot_general": ("wide_matmul", "wide_dot"), "convert_element_type": ("cast_on_shard",)}


def dtypes_of(fun, *args, primitive="dot_general", **kwargs):
    """[(input dtypes..., output dtype)] for every ``primitive`` (a ``dot_general``: jamp's wide ones too) in
    ``make_jaxpr(fun)(*args)``."""
    closed = jax.make_jaxpr(fun, **kwargs)(*args)
    names = (primitive, *ALSO.get(primitive, ()))
    return [
        # a wide_matmul's operands after the two it multiplies are the wider values they were cast from
        tuple(str(v.aval.dtype) for v in e.invars[: 2 if e.primitive.name == "wide_matmul" else None])
        + (str(e.outvars[0].aval.dtype),)
        for e in eqns(closed)
        if e.primitive.name in names
    ]


def count(fun, *args, primitive):
    """How many ``primitive`` equations (jamp's own forms of it too, see ``ALSO``) ``make_jaxpr(fun)(*args)`` has."""
    names = (primitive, *ALSO.get(primitive, ()))
    return sum(e.primitive.name in names for e in eqns(jax.make_jaxpr(fun)(*args)))


def once_per_run(key: str, compute) -> str:
    """``compute()`` (a string), computed once per test run: pytest-xdist sets a module-scoped fixture up on every
    worker that runs one of its tests, so under it the first worker to ask computes and the others read the result
    (a file per run, behind a lock). Without xdist, or without ``fcntl``, it is computed here."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    if uid is None or fcntl is None:
        return compute()
    folder = os.path.join(tempfile.gettempdir(), f"jamp-tests-{uid}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, key)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):  # the others wait on the lock, so they never read a file half written
            with open(path, "w") as f:
                f.write(compute())
        with open(path) as f:
            return f.read()


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


def lower_for_cuda(fn, *args):
    """``jax.jit(fn)`` lowered for CUDA from any host (Pallas GPU kernels are checked this way on CPUs).

    Since jax 0.11 the Triton lowering asks which GPU it targets and fails on a host without one; there
    the host's device kind is registered as an H100 (sm_90, what jax 0.10 assumes) for the lowering only
    (a patch of JAX's Pallas GPU registry that the tests make, never jamp).
    """
    traced = jax.jit(fn).trace(*args)
    with _host_as_h100():
        return traced.lower(lowering_platforms=("cuda",))


@contextlib.contextmanager
def _host_as_h100():
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # jax 0.10: the lowering falls back to sm_90 by itself
        yield
        return
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "gpu" or kind in gpu_info.registry:
        yield
        return
    gpu_info.registry[kind] = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    try:
        yield
    finally:
        del gpu_info.registry[kind]
