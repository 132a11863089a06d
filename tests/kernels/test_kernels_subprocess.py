"""unscale_and_check where JAX must be configured before import: 8 host devices, and float64 (x64).

Each child prints one JSON object of observations; the assertions are here.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_child(code: str, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MULTIDEVICE = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jamp_kernels
from helpers import lower_for_cuda

INV = np.float32(0.25)
rng = np.random.default_rng(0)
host = {"w": rng.standard_normal((64, 30)).astype(np.float32),
        "b": rng.standard_normal(40).astype(jnp.bfloat16), "r": np.ones(5, np.float16)}
specs = {"w": P("d", "m"), "b": P("m"), "r": P()}
poisoned = dict(host, w=host["w"].copy())
poisoned["w"][-1, -1] = np.nan            # lives on one device only

def exact(out):
    return all(np.array_equal(np.asarray(out[k]), (host[k].astype(np.float32) * INV).astype(host[k].dtype))
               for k in host)

report = {}
for mode in ("explicit", "auto"):
    mesh = jax.make_mesh((4, 2), ("d", "m"), axis_types=(getattr(AxisType, mode.title()),) * 2)
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    for backend in ("interpret", "xla", "auto"):
        fn = jax.jit(lambda g, inv: jamp_kernels.unscale_and_check(g, inv, backend=backend))
        if mode == "explicit":     # jax.make_mesh's default: the specs are part of the leaves' types
            clean, bad = jax.device_put(host, shard), jax.device_put(poisoned, shard)
        else:                      # Auto axes: only XLA's partitioner sees the specs
            fn = jax.jit(fn, in_shardings=(shard, None))
            clean, bad = host, poisoned
        out, found = fn(clean, INV)
        report[f"{mode}/{backend}"] = {
            "exact": exact(out), "found_clean": bool(found), "found_bad": bool(fn(bad, INV)[1]),
            "all_gather": "all-gather" in fn.lower(clean, INV).compile().as_text(),
            "specs": [str(out["w"].sharding.spec), str(out["b"].sharding.spec)],
            "replicated_stays_replicated": out["r"].sharding.is_fully_replicated}

# An unevenly split intermediate: XLA pads the last shard, which the kernel must not read.
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
fn = jax.jit(lambda x: jamp_kernels.unscale_and_check([jnp.sin(x)[:7]], INV, backend="interpret")[1],
             in_shardings=NamedSharding(mesh, P("d")))
x = np.ones(8, np.float32)
report["uneven_flags"] = [bool(fn(np.where(np.arange(8) == i, np.nan, x))) for i in (7, 6)]

# The kernel inside a user's shard_map: it returns the local flag, the caller reduces it.
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
w = jax.device_put(host["w"], NamedSharding(mesh, P("d")))
w_bad = jax.device_put(poisoned["w"], NamedSharding(mesh, P("d")))
for backend, check_vma in (("interpret", False), ("xla", True)):
    def step(g):
        out, found = jamp_kernels.unscale_and_check(g, INV, backend=backend)
        return out, jax.lax.pmax(found, "d")
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P()), check_vma=check_vma))
    out, found = fn(w)
    report[f"shard_map/{backend}"] = {
        "exact": bool(np.array_equal(np.asarray(out), host["w"] * INV)), "found_clean": bool(found),
        "found_bad": bool(fn(w_bad)[1]), "all_gather": "all-gather" in fn.lower(w).compile().as_text()}

# pmap: one flag per device, as torch's per-device found_inf.
stacked = np.stack([np.ones(9, np.float32)] * 8)
stacked[3, 8] = np.inf
flags = jax.pmap(lambda g: jamp_kernels.unscale_and_check(g, INV, backend="interpret")[1])(stacked)
report["pmap_flags"] = [bool(f) for f in flags]

# The Triton kernel on sharded grads lowers for CUDA, inside the shard_map wrapper.
mesh = jax.make_mesh((4, 2), ("d", "m"))
grads = jax.device_put(host, {k: NamedSharding(mesh, s) for k, s in specs.items()})
text = lower_for_cuda(lambda g: jamp_kernels.unscale_and_check(g, INV, backend="pallas"), grads).as_text()
report["cuda"] = {"triton_calls": text.count("__gpu$xla.gpu.triton"), "manual": "sdy.manual_computation" in text}
# The XLA check off a CPU is a reduction per leaf that XLA partitions itself: no shard-by-shard wrapper,
# which would gather an unevenly split leaf.
text = lower_for_cuda(lambda g: jamp_kernels.has_nonfinite(g, backend="xla"), grads).as_text()
report["cuda_xla_check_manual"] = "sdy.manual_computation" in text
from jamp_kernels import dispatch, xla
xla.CHECK_OF_PLATFORM = {"default": xla._reduced}  # that form, run here
dispatch._check.clear_cache()
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
split = NamedSharding(mesh, P("d"))
fn = jax.jit(lambda x: jamp_kernels.has_nonfinite([jax.lax.with_sharding_constraint(x[:1001] * 2, split)],
                                                  backend="xla"), in_shardings=split)
x = np.ones((1008, 16), np.float32)
report["uneven_reduced"] = {  # 1001 rows over 8 devices; an inf in row 1000 counts, one in row 1001 is sliced away
    "all_gather": "all-gather" in fn.lower(x).compile().as_text(),
    "flags": [bool(fn(np.where(np.arange(1008)[:, None] == row, np.inf, x))) for row in (1001, 1000)]}
print(json.dumps(report))
"""


@pytest.mark.multidevice
def test_sharded_gradients_stay_sharded_on_8_devices():
    # 8 host devices: pinned to the CPU backend, which also holds on a GPU machine
    report = run_child(MULTIDEVICE, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    for mode in ("explicit", "auto"):
        for backend in ("interpret", "xla", "auto"):
            r = report[f"{mode}/{backend}"]
            assert r["exact"] and not r["found_clean"] and r["found_bad"], (mode, backend, r)
            assert not r["all_gather"], (mode, backend)
            assert r["specs"] == ["P('d', 'm')", "P('m',)"] and r["replicated_stays_replicated"], (mode, backend, r)
    for backend in ("interpret", "xla"):
        r = report[f"shard_map/{backend}"]
        assert r["exact"] and not r["found_clean"] and r["found_bad"] and not r["all_gather"], (backend, r)
    assert report["uneven_flags"] == [False, True]  # the NaN at index 7 is sliced away
    assert report["pmap_flags"] == [False, False, False, True, False, False, False, False]
    assert report["cuda"] == {"triton_calls": 1, "manual": True}
    assert not report["cuda_xla_check_manual"]
    assert report["uneven_reduced"] == {"all_gather": False, "flags": [False, True]}


FLOAT64 = """
import json
import jax, jax.numpy as jnp, numpy as np
import jamp_kernels
from helpers import lower_for_cuda

inv = np.float32(1 / 3)
rng = np.random.default_rng(0)
grads = {f"n{n}": rng.standard_normal(n) * 1e300 for n in (1, 7, 1000, 4097)}
grads["three"] = np.array([3.0])
grads["single"] = rng.standard_normal(33).astype(np.float32)
want = {k: g * np.float64(inv) if g.dtype == np.float64 else g * inv for k, g in grads.items()}
report = {}
for backend in ("interpret", "xla", "auto"):
    fn = jax.jit(lambda g: jamp_kernels.unscale_and_check(g, inv, backend=backend))
    out, found = fn(grads)
    detected = []
    for key, g in grads.items():
        for position in (0, g.size - 1):
            bad = dict(grads, **{key: g.copy()})
            bad[key][position] = np.nan
            detected.append(bool(fn(bad)[1]))
    report[backend] = {"dtypes": sorted({str(o.dtype) for o in out.values()}),
                       "exact": all(np.array_equal(np.asarray(out[k]), want[k]) for k in grads),
                       "three": float(out["three"][0]), "found_clean": bool(found), "all_detected": all(detected)}
text = lower_for_cuda(lambda g: jamp_kernels.unscale_and_check(g, inv, backend="pallas"), grads).as_text()
report["triton_calls"] = text.count("__gpu$xla.gpu.triton")
print(json.dumps(report))
"""


def test_float64_leaves_compute_in_float64():
    """1e300-sized values would overflow float32; ``3 * float32(1/3)`` is 1.0000000298023224 (torch)."""
    report = run_child(FLOAT64, JAX_ENABLE_X64="1")
    for backend in ("interpret", "xla", "auto"):
        r = report[backend]
        assert r["dtypes"] == ["float32", "float64"] and r["exact"], (backend, r)
        assert r["three"] == 1.0000000298023224 and not r["found_clean"] and r["all_detected"], (backend, r)
    assert report["triton_calls"] == 1
