"""A run resumed from a checkpoint in a fresh process continues bit for bit as the uninterrupted run, by every route
users save with (issue 43, points 1 and 2): the state is a function of params, hyperparameters and gradients,
so a process that builds its scalers in another order restores the same bits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent(
    """
    import hashlib, json, pickle, sys, jax, jax.numpy as jnp, numpy as np, optax, jamp
    import flax.serialization, orbax.checkpoint as ocp

    folder, phase = sys.argv[1], sys.argv[2]
    if phase == "resume":
        other = jamp.scaler(optax.sgd(0.1), init_scale=8.0)  # built first here: creation order differs
    tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2, warn_after_skips=2)
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    x = jnp.linspace(0.0, 1.0, 24).reshape(6, 4)

    @jax.jit
    def step(p, s, poison):
        loss = lambda q: jnp.mean((x @ q["w"].T + q["b"][:3]) ** 2) * poison
        grads = jax.grad(lambda q: jamp.scale(loss(q), s))(p)
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    def run(p, s, poisons):
        for poison in poisons:
            p, s = step(p, s, poison)
        return p, s

    def digest(tree):
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(tree):
            h.update(np.asarray(leaf).tobytes())
        return h.hexdigest()

    def torch_view(p, s):  # all but jamp's episode counters, which a torch-format state_dict does not carry
        return p, s._replace(consecutive_skips=0, warned=False, skip_episodes=0)

    FIRST, THEN = [1.0, jnp.inf, jnp.inf, 1.0, 1.0], [1.0, jnp.inf, 1.0, 1.0]
    ROUTES = ["pickle", "flax_msgpack", "flax_state_dict", "orbax_pytree", "orbax_standard", "torch_state_dict"]
    if phase == "save":
        p, s = run(params, tx.init(params), FIRST)
        with open(f"{folder}/state.pkl", "wb") as f:
            pickle.dump(jax.device_get((p, s)), f)
        with open(f"{folder}/state.msgpack", "wb") as f:
            f.write(flax.serialization.to_bytes((p, s)))
        with open(f"{folder}/state_dict.pkl", "wb") as f:
            pickle.dump(jax.device_get(flax.serialization.to_state_dict((p, s))), f)
        ocp.PyTreeCheckpointer().save(f"{folder}/pytree", (p, s))
        with ocp.StandardCheckpointer() as c:
            c.save(f"{folder}/standard", (p, s))
        with open(f"{folder}/torch.pkl", "wb") as f:  # as torch.save({"model":..., "optimizer":..., "scaler":...})
            pickle.dump({"model": jax.device_get(p), "optimizer": jax.device_get(s.inner_state),
                         "scaler": jamp.state_dict(s)}, f)
        p, s = run(p, s, THEN)
        print(json.dumps({"uninterrupted": digest((p, s)), "torch_view": digest(torch_view(p, s))}))
    else:
        target = (params, tx.init(params))
        restored = {}
        with open(f"{folder}/state.pkl", "rb") as f:
            restored["pickle"] = jax.tree.map(jnp.asarray, pickle.load(f))
        with open(f"{folder}/state.msgpack", "rb") as f:
            restored["flax_msgpack"] = flax.serialization.from_bytes(target, f.read())
        with open(f"{folder}/state_dict.pkl", "rb") as f:
            restored["flax_state_dict"] = flax.serialization.from_state_dict(target, pickle.load(f))
        restored["orbax_pytree"] = ocp.PyTreeCheckpointer().restore(f"{folder}/pytree", item=target)
        with ocp.StandardCheckpointer() as c:
            restored["orbax_standard"] = c.restore(f"{folder}/standard", jax.eval_shape(lambda: target))
        with open(f"{folder}/torch.pkl", "rb") as f:
            saved = pickle.load(f)
        fresh = target[1]._replace(inner_state=jax.tree.map(jnp.asarray, saved["optimizer"]))
        restored["torch_state_dict"] = (jax.tree.map(jnp.asarray, saved["model"]),
                                        jamp.load_state_dict(fresh, saved["scaler"]))
        out = {}
        for route in ROUTES:
            p, s = restored[route]
            p, s = run(p, s, THEN)
            out[route] = digest(torch_view(p, s) if route == "torch_state_dict" else (p, s))
        print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    outs = []
    for phase in ("save", "resume"):
        proc = subprocess.run([sys.executable, "-c", CODE, str(folder), phase], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("route", ["pickle", "flax_msgpack", "flax_state_dict", "orbax_pytree", "orbax_standard"])
def test_a_run_resumed_in_a_fresh_process_continues_bit_for_bit(digests, route):
    uninterrupted, resumed = digests
    assert resumed[route] == uninterrupted["uninterrupted"]


def test_a_torch_format_state_dict_resumes_torch_s_state_bit_for_bit(digests):
    """torch's five keys carry the scale and its rule; jamp's episode counters are not among them, and the rest of
    the state is the freshly built scaler's, the same bits as the saved one's."""
    uninterrupted, resumed = digests
    assert resumed["torch_state_dict"] == uninterrupted["torch_view"]
