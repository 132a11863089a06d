"""Distributed training with autocast + jamp.scaler: every device and every process takes the same skip decision.

* pmap data parallel with ``axis_name``, grads averaged only inside the wrapped optimizer;
* jit + NamedSharding on an 8-device mesh, data parallel and FSDP-style (nothing to pass): the scaler
  update never all-gathers gradients and the state keeps its sharding;
* shard_map with ``axis_name`` naming the manual axes (one name or a tuple);
* 2 processes x 2 CPU devices over ``jax.distributed`` (gloo on loopback), overflow on one process only;
* an ``axis_name`` that is not bound; and the three examples in examples/.

Everything runs in child interpreters: XLA_FLAGS (or jax's config) must be set before jax starts, and the
pytest process stays single-device. Each child prints one JSON object; the assertions are here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from helpers import once_per_run, run_subprocess

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multidevice

EIGHT_DEVICES = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jamp

N = jax.device_count()
report = {"devices": N}


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def record(key, fn, *args):
    # report[key] = fn(*args), or {"error": ...}: one broken section fails only its own tests
    try:
        report[key] = fn(*args)
    except Exception as e:
        report[key] = {"error": f"{type(e).__name__}: {e}"}
rng = np.random.default_rng(0)     # NumPy on the host: every eager jnp op on 8 devices compiles a program
PARAMS = {"w1": rng.standard_normal((16, 32), np.float32) / 4, "b1": np.zeros(32, np.float32),
          "w2": rng.standard_normal((32, 8), np.float32) / 6}
X = rng.standard_normal((64, 16), np.float32)
Y = np.tile(X.sum(-1, keepdims=True), (1, 8))
X_BAD = X.copy()
X_BAD[61, 0] = 1e5                 # float16 overflow in the forward pass; row 61 is in the last batch shard


def model(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def loss_fn(p, x, y):
    return jnp.mean((jamp.autocast(model, dtype="float16")(p, x) - y) ** 2)


def same(a, b):
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def replicas_agree(t):
    return all(bool(np.all(np.asarray(leaf) == np.asarray(leaf)[:1])) for leaf in jax.tree.leaves(t))


def per_device(x):
    return np.asarray(x).tolist()


# --- pmap: local grads, averaged only inside the wrapped optimizer ---------------------------------
def pmap_run(axis_name):
    average = optax.stateless(lambda g, p: jax.lax.pmean(g, "batch"))
    tx = jamp.scaler(optax.chain(average, optax.adam(1e-2)), init_scale=2.0**10, growth_interval=100,
                     axis_name=axis_name)

    @jax.pmap
    def init(p):
        return tx.init(p)

    def step(p, s, x, y):
        grads = jax.grad(lambda p: jamp.scale(loss_fn(p, x, y), s))(p)   # this replica's grads only
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.pmap(step, axis_name="batch")
    p0 = jax.tree.map(lambda a: np.stack([a] * N), PARAMS)
    s0 = init(p0)
    xs, ys = X.reshape(N, -1, 16), Y.reshape(N, -1, 8)
    p1, s1 = step(p0, s0, X_BAD.reshape(N, -1, 16), ys)      # only replica N-1 sees the overflow
    p2, s2 = step(p1, s1, xs, ys)
    return {"found": per_device(s1.found_inf), "scale": per_device(s1.scale),
            "params_kept": same(p1, p0), "inner_kept": same(s1.inner_state, s0.inner_state),
            "agree": replicas_agree((p1, s1)), "clean_found": per_device(s2.found_inf),
            "clean_applied": [bool(np.any(np.asarray(p2["w1"])[d] != np.asarray(p1["w1"])[d])) for d in range(N)],
            "clean_agree": replicas_agree((p2, s2)), "finite": bool(np.all(np.isfinite(np.asarray(p2["w1"]))))}


record("pmap", pmap_run, "batch")
record("pmap_no_axis_name", pmap_run, None)


# --- jit + NamedSharding: data parallel and FSDP-style, nothing to pass -------------------------------
def placement(mesh, layout):
    # FSDP: every leaf (params, grads, Adam moments) split on its first dimension; DP: replicated.
    def sharding(leaf):
        split = layout == "fsdp" and leaf.ndim > 0 and leaf.shape[0] % N == 0
        return NamedSharding(mesh, P("d") if split else P())
    return lambda tree: jax.tree.map(sharding, tree)


def shardings_equal(a, b):
    return all(x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def spec_strings(tree):
    return [str(leaf.sharding.spec) for leaf in jax.tree.leaves(tree) if leaf.ndim]


def hlo(tx, grads, state, params):
    return jax.jit(tx.update).lower(grads, state, params).compile().as_text()


def jit_run(layout):
    mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))
    place = placement(mesh, layout)
    tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**10, growth_interval=100)
    p0 = jax.device_put(PARAMS, place(PARAMS))
    s0 = jax.jit(tx.init, out_shardings=place(jax.eval_shape(tx.init, p0)))(p0)

    @jax.jit
    def train_step(p, s, x, y, poison):
        # poison adds sum(w1 * poison) to the loss: a huge poison entry overflows that one gradient element
        grads = jax.grad(lambda p: jamp.scale(loss_fn(p, x, y) + jnp.sum(p["w1"] * poison), s))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    batch = NamedSharding(mesh, P("d"))
    x, x_bad, y = (jax.device_put(a, batch) for a in (X, X_BAD, Y))
    poison = np.zeros((16, 32), np.float32)
    if layout == "fsdp":
        poison[13, 5] = 3e38                          # row 13 of w1 lives on device 13 // 2 = 6 only
        x_bad = x
    zero = jax.device_put(np.zeros_like(poison), p0["w1"].sharding)
    poison = jax.device_put(poison, p0["w1"].sharding)
    p1, s1 = train_step(p0, s0, x_bad, y, poison)
    p2, s2 = train_step(p1, s1, x, y, zero)
    grads = jax.device_put(PARAMS, place(PARAMS))
    text = hlo(tx, grads, s0, p0)
    return {"found": bool(s1.found_inf), "scale": float(s1.scale), "params_kept": same(p1, p0),
            "inner_kept": same(s1.inner_state, s0.inner_state), "clean_found": bool(s2.found_inf),
            "clean_applied": not same(p2, p1), "adam_count": int(s2.inner_state[0].count),
            "shardings_kept": shardings_equal((p0, s0), (p1, s1)) and shardings_equal((p0, s0), (p2, s2)),
            "param_specs": spec_strings(p2), "moment_specs": spec_strings(s2.inner_state[0].mu),
            "all_gather": "all-gather" in text, "all_reduce": "all-reduce" in text}


record("jit_dp", jit_run, "dp")
record("jit_fsdp", jit_run, "fsdp")


def sharded_update(axis_type, backend):
    # The scaler update alone on FSDP-sharded grads with an inf in one shard: both mesh axis types, and
    # the kernel path ("interpret", the Pallas kernel that backend="auto" picks on a GPU) next to "xla".
    mesh = jax.make_mesh((N,), ("d",), axis_types=(axis_type,))
    place = placement(mesh, "fsdp")
    tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**10, backend=backend)
    with jax.set_mesh(mesh):
        p = jax.device_put(PARAMS, place(PARAMS))
        s = jax.jit(tx.init, out_shardings=place(jax.eval_shape(tx.init, p)))(p)
        bad = jax.tree.map(np.copy, PARAMS)
        bad["w2"][29, 3] = np.inf                     # row 29 of w2 lives on device 7 only
        grads = jax.device_put(bad, place(PARAMS))
        updates, s1 = jax.jit(tx.update)(grads, s, p)
        text = hlo(tx, grads, s, p)
    shards = [not np.all(np.isfinite(np.asarray(sh.data))) for sh in grads["w2"].addressable_shards]
    return {"nonfinite_shards": shards, "found": bool(s1.found_inf), "scale": float(s1.scale),
            "zero_updates": all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates)),
            "inner_kept": same(s1.inner_state, s.inner_state),
            "shardings_kept": shardings_equal(s, s1) and shardings_equal(p, updates),
            "all_gather": "all-gather" in text}


for axis_type in (AxisType.Auto, AxisType.Explicit):
    for backend in ("xla", "interpret"):
        record(f"update/{axis_type.name}/{backend}", sharded_update, axis_type, backend)


# --- shard_map: the flag is reduced over the manual axes named by axis_name --------------------------
def shard_map_run(axis_name, check_vma):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    tx = jamp.scaler(optax.adam(1e-2), init_scale=4.0, axis_name=axis_name)
    w = np.linspace(-1.0, 1.0, 8 * 4, dtype=np.float32).reshape(8, 4)
    w_bad = w.copy()
    w_bad[7, 3] = np.inf                              # only on the device at data=3, model=1
    split = P("data", "model")
    sharding = NamedSharding(mesh, split)
    with jax.set_mesh(mesh):
        p = {"w": jax.device_put(w, sharding)}
        s = jax.jit(tx.init)(p)
        state_specs = jax.tree.map(lambda a: split if a.ndim == 2 else P(), s)

        def step(g, s, p):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s, s.found_inf[None, None]

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=({"w": split}, state_specs, {"w": split}),
                                  out_specs=({"w": split}, state_specs, split), check_vma=check_vma))
        p1, s1, flags = f({"w": jax.device_put(w_bad, sharding)}, s, p)
        p2, s2, _ = f({"w": jax.device_put(w, sharding)}, s1, p1)
    return {"flags": np.asarray(flags).astype(int).tolist(), "found": bool(s1.found_inf),
            "scale": float(s1.scale), "params_kept": same(p1, p), "inner_kept": same(s1.inner_state, s.inner_state),
            "clean_applied": not same(p2, p1), "clean_found": bool(s2.found_inf)}


record("shard_map_both_axes", shard_map_run, ("data", "model"), True)
record("shard_map_one_axis_unchecked", shard_map_run, "data", False)
record("shard_map_one_axis_checked", shard_map_run, "data", True)


# --- an axis_name that is not bound --------------------------------------------------------------------
tx = jamp.scaler(optax.sgd(1.0), axis_name="batch")
g = {"w": np.ones(8, np.float32)}
s = tx.init(g)
mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Explicit,))
in_map = lambda check_vma: jax.shard_map(lambda g, s: tx.update(g, s)[1].scale, mesh=mesh,
                                         in_specs=({"w": P("d")}, P()), out_specs=P(), check_vma=check_vma)
report["unbound"] = {
    "jit": error_of(lambda: jax.jit(tx.update).trace(g, s)),
    "eager": error_of(lambda: tx.update(g, s)),
    "pmap_other_name": error_of(lambda: jax.make_jaxpr(jax.pmap(tx.update, axis_name="i"))(
        *jax.tree.map(lambda a: a[None], (g, s)))),
}
with jax.set_mesh(mesh):
    g_split = {"w": jax.device_put(g["w"], NamedSharding(mesh, P("d")))}
    report["unbound"]["shard_map_checked"] = error_of(lambda: jax.jit(in_map(True)).trace(g_split, s))
    report["unbound"]["shard_map_unchecked"] = error_of(lambda: jax.jit(in_map(False)).trace(g_split, s))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def eight():
    out = once_per_run("distributed_eight", lambda: run_subprocess(EIGHT_DEVICES, devices=8))
    return json.loads(out.strip().splitlines()[-1])


def section(eight: dict, key: str) -> dict:
    """The child's observations for ``key``; fails with the child's exception if that section raised."""
    r = eight[key]
    assert "error" not in r, r.get("error")
    return r


def test_eight_devices(eight):
    assert eight["devices"] == 8


# -- pmap ---------------------------------------------------------------------------------------------


def test_pmap_overflow_on_one_replica_skips_every_replica(eight):
    r = section(eight, "pmap")
    assert r["found"] == [True] * 8 and r["scale"] == [512.0] * 8
    assert r["params_kept"] and r["inner_kept"] and r["agree"]


def test_pmap_clean_step_applies_on_every_replica(eight):
    r = section(eight, "pmap")
    assert r["clean_found"] == [False] * 8 and r["clean_applied"] == [True] * 8
    assert r["clean_agree"] and r["finite"]


def test_pmap_without_axis_name_is_refused_while_tracing(eight):
    """Without axis_name the replica that saw the overflow would skip alone while the others applied the update
    the pmean inside the optimizer averaged: the replicas would diverge in silence (issue 43, point 4a). The
    optimizer's traced update shows the pmean, so the scaler refuses and names the fix."""
    said = eight["pmap_no_axis_name"].get("error", "")
    assert "ValueError: jamp.scaler(axis_name=None): the optimizer it wraps communicates over the axis 'batch'" in said
    assert said.endswith("Pass jamp.scaler(..., axis_name='batch')")


# -- jit + NamedSharding ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_jit_sharded_train_step_skips_on_one_shards_overflow(eight, layout):
    r = section(eight, f"jit_{layout}")
    assert r["found"] and r["scale"] == 512.0 and r["params_kept"] and r["inner_kept"]
    assert not r["clean_found"] and r["clean_applied"] and r["adam_count"] == 1


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_jit_sharded_state_keeps_its_sharding_and_update_never_all_gathers(eight, layout):
    r = section(eight, f"jit_{layout}")
    assert r["shardings_kept"] and not r["all_gather"]
    want = "P('d',)" if layout == "fsdp" else "P()"
    assert set(r["param_specs"]) == {want} and set(r["moment_specs"]) == {want}
    if layout == "fsdp":
        assert r["all_reduce"]  # the flag, a scalar, is what crosses devices


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_sharded_update_with_inf_in_one_shard(eight, axis_type, backend):
    r = section(eight, f"update/{axis_type}/{backend}")
    assert r["nonfinite_shards"] == [d == 7 for d in range(8)]
    assert r["found"] and r["scale"] == 512.0 and r["zero_updates"] and r["inner_kept"]
    assert r["shardings_kept"] and not r["all_gather"]


# -- shard_map ----------------------------------------------------------------------------------------


def test_shard_map_axis_name_tuple_reduces_over_every_manual_axis(eight):
    r = section(eight, "shard_map_both_axes")
    assert r["flags"] == [[1, 1]] * 4 and r["found"] and r["scale"] == 2.0
    assert r["params_kept"] and r["inner_kept"] and r["clean_applied"] and not r["clean_found"]


def test_shard_map_axis_name_missing_an_axis_without_check_vma_is_silently_wrong(eight):
    """Documented pitfall: psum over "data" only leaves the model=0 column unaware of the inf at model=1."""
    r = section(eight, "shard_map_one_axis_unchecked")
    assert r["flags"] == [[0, 1]] * 4
    assert not r["found"] and not r["params_kept"]  # the out_specs=P() state came from device (0, 0)


def test_shard_map_axis_name_missing_an_axis_with_check_vma_raises(eight):
    assert eight["shard_map_one_axis_checked"]["error"].startswith("ValueError")


def test_shard_map_axis_name_missing_an_axis_error_names_it(eight):
    error = eight["shard_map_one_axis_checked"]["error"]
    assert "axis_name" in error and "model" in error


# -- an axis_name that is not bound -------------------------------------------------------------------

UNBOUND = ["jit", "eager", "pmap_other_name", "shard_map_checked", "shard_map_unchecked"]


@pytest.mark.parametrize("where", UNBOUND)
def test_unbound_axis_name_fails_at_trace_time(eight, where):
    error = eight["unbound"][where]
    assert error is not None  # raised while tracing: nothing ran, so no device waits in a collective
    assert error.startswith("NameError") and "batch" in error


@pytest.mark.parametrize("where", UNBOUND)
def test_unbound_axis_name_error_names_the_scaler_argument(eight, where):
    error = eight["unbound"][where]
    assert "jamp.scaler" in error and "axis_name" in error


# -- several processes --------------------------------------------------------------------------------

WORKER = r"""
import hashlib, json, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
coordinator, num_processes, process_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)

import jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jamp

OVERFLOW = {(1, 2), (1, 5)}                     # (process, step): only process 1's data overflows
mesh = jax.make_mesh((jax.device_count(),), ("batch",))
replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
params = jax.device_put({"w": jnp.full((8, 4), 0.1), "b": jnp.zeros(4)}, replicated)
tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**12, growth_interval=2)
state = jax.jit(tx.init, out_shardings=replicated)(params)


def loss_fn(p, x, y):
    return jnp.mean((jamp.autocast(lambda p, x: x @ p["w"] + p["b"], dtype="float16")(p, x) - y) ** 2)


@jax.jit
def train_step(p, s, x, y):
    loss, grads = jax.value_and_grad(lambda p: jamp.scale(loss_fn(p, x, y), s))(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss / jamp.get_scale(s)


def local_batch(step):
    rng = np.random.default_rng(100 * step + process_id)   # every process has its own data
    x = rng.standard_normal((4, 8)).astype(np.float32)
    if (process_id, step) in OVERFLOW:
        x[0, 0] = 1e5                                   # inf in float16
    return x, np.tile(x.sum(1, keepdims=True), (1, 4))


skipped, scales = [], []
for step in range(8):
    x, y = (jax.make_array_from_process_local_data(batch, a) for a in local_batch(step))
    params, state, _ = train_step(params, state, x, y)
    if bool(jamp.found_inf(state)):
        skipped.append(step)
    scales.append(float(jamp.get_scale(state)))


def digest(shard_index):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves((params, state)):
        h.update(np.asarray(leaf.addressable_shards[shard_index].data).tobytes())
    return h.hexdigest()


# The skipped-steps report across processes: process 1's data overflows three steps in a row (an episode with
# warn_after_skips=2); every process skips them, and jamp.report_skipped_steps on each process says so once.
import warnings
tx2 = jamp.scaler(optax.adam(1e-2), init_scale=2.0**12, warn_after_skips=2, warn_below_scale=None)
state = jax.jit(tx2.init, out_shardings=replicated)(params)
OVERFLOW = {(1, 8), (1, 9), (1, 10)}


@jax.jit
def episode_step(p, s, x, y):
    grads = jax.grad(lambda p: jamp.scale(loss_fn(p, x, y), s))(p)
    updates, s = tx2.update(grads, s, p)
    return optax.apply_updates(p, updates), s


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(8, 11):
        x, y = (jax.make_array_from_process_local_data(batch, a) for a in local_batch(step))
        params, state = episode_step(params, state, x, y)
    jamp.report_skipped_steps(state)
reports = [str(w.message)[:58] for w in caught if w.category is jamp.SkippedStepsWarning]

# What crosses processes in the gradient step: the floating reductions' dtypes, read after partitioning.
grad_step = jax.jit(jax.grad(loss_fn))
reduced = sorted({r.dtype for r in jamp.collectives(grad_step, params, x, y)
                  if r.kind in ("all-reduce", "reduce-scatter") and r.dtype.startswith("float")})

print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(), "skipped": skipped,
                  "reduced": reduced,
                  "scales": scales, "digests": [digest(i) for i in range(jax.local_device_count())],
                  "finite": bool(np.all(np.isfinite(np.asarray(params["w"].addressable_shards[0].data)))),
                  "episode_skips": int(np.asarray(state.consecutive_skips.addressable_shards[0].data)),
                  "reports": reports}))
jax.distributed.shutdown()
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(commands: list[list[str]], timeout: float) -> list[str]:
    """Run the commands at once; return their stdouts. On a failure or the timeout, kill every process group.

    Each command starts a session of its own, so killing its group also ends the workers it launched; a
    failed worker is not waited for by the others (they would block in a collective).
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    with contextlib.ExitStack() as files:
        logs = [
            (files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
            for _ in commands
        ]
        procs = [
            subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT, env=env, start_new_session=True)
            for cmd, (out, err) in zip(commands, logs)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.poll() not in (None, 0)]
                assert not failed and time.monotonic() < deadline, _failure(procs, logs)
                time.sleep(0.1)
            assert all(p.returncode == 0 for p in procs), _failure(procs, logs)
            return [_read(out) for out, _ in logs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _read(f) -> str:
    f.seek(0)
    return f.read()


def _failure(procs, logs) -> str:
    return "\n".join(
        f"--- process {i} (exit {p.poll()}):\n{_read(out)[-2000:]}\n{_read(err)[-4000:]}"
        for i, (p, (out, err)) in enumerate(zip(procs, logs))
    )


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> list[dict]:
    def run() -> str:
        script = tmp_path_factory.mktemp("multiprocess") / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        coordinator = f"127.0.0.1:{free_port()}"
        outs = run_group([[sys.executable, str(script), coordinator, "2", str(i)] for i in range(2)], timeout=90)
        return json.dumps([json.loads(out.strip().splitlines()[-1]) for out in outs])

    return sorted(json.loads(once_per_run("distributed_workers", run)), key=lambda r: r["process"])


def test_two_processes_see_four_devices(workers):
    assert [(r["process"], r["devices"], len(r["digests"])) for r in workers] == [(0, 4, 2), (1, 4, 2)]


def test_the_gradients_cross_processes_in_float32(workers):
    """The float16 autocast loss's float32 weights get float32 gradients out of their matmuls, so the reduction
    across processes is float32, as torch AMP + DDP all-reduces ``param.grad`` (jamp.casting.wide_cotangents)."""
    assert [r["reduced"] for r in workers] == [["float32"], ["float32"]]


def test_every_process_skips_the_steps_where_one_process_overflowed(workers):
    assert [r["skipped"] for r in workers] == [[2, 5], [2, 5]]
    # growth_interval=2: 4096 -> 8192 after steps 0-1, halved at 2, doubled after 3-4, halved at 5, ...
    assert workers[0]["scales"] == workers[1]["scales"] == [4096, 8192, 4096, 4096, 8192, 4096, 4096, 8192]


def test_every_process_skips_an_episode_and_reports_it_once(workers):
    assert [r["episode_skips"] for r in workers] == [3, 3]
    assert [r["reports"] for r in workers] == [["jamp.scaler at opt_state: 3 update(s) in a row were skippe"]] * 2


def test_every_process_ends_with_identical_parameters_and_scale(workers):
    digests = {d for r in workers for d in r["digests"]}
    assert len(digests) == 1 and all(r["finite"] for r in workers)


def test_launcher_kills_the_group_on_failure(tmp_path):
    """A worker that fails while the other waits for it in jax.distributed.initialize: no hang, no orphan."""
    pid_file = tmp_path / "pid0"
    code = textwrap.dedent("""
        import os, sys, time, jax
        jax.config.update("jax_platforms", "cpu")
        if sys.argv[1] == "0":
            open(sys.argv[3], "w").write(str(os.getpid()))
            jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=0)  # waits for process 1
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.05)
        sys.exit(3)
    """)
    coordinator = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"process 1 \(exit 3\)"):
        run_group([[sys.executable, "-c", code, str(i), coordinator, str(pid_file)] for i in range(2)], timeout=60)
    assert time.monotonic() - start < 30
    waiting = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(waiting, 0)


# -- the examples -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "expected", "overflow_step"),
    [
        ("data_parallel_pmap.py", ["replicas agree: True"], 25),
        ("fsdp_sharded.py", ["all-gather in the scaler update: False", "shardings kept: True"], 25),
        ("multiprocess.py", ["[process 0/2] processes agree: True", "[process 1/2] processes agree: True"], 10),
    ],
)
def test_example_runs(script, expected, overflow_step):
    out = run_group([[sys.executable, str(ROOT / "examples" / script)]], timeout=120)[0]
    assert all(line in out for line in expected), out
    skipped = [json.loads(m) for m in re.findall(r"skipped steps: (\[[\d, ]*\])", out)]
    assert skipped and all(overflow_step in steps for steps in skipped), out
    assert "final loss:" in out, out
