"""Data-parallel float16 training with ``jax.pmap``: autocast inside, ``jamp.scaler(..., axis_name="batch")``.

    python examples/data_parallel_pmap.py [--steps 60] [--overflow-step 25]

Runs on 8 host CPU devices by default (XLA_FLAGS below, unless you set it); on a machine with GPUs or
TPUs the same script runs one replica per local accelerator.

Every replica differentiates the loss of its own slice of the batch, and the scaler checks those local,
not yet averaged gradients: ``axis_name="batch"`` ORs the found-inf flag over the replicas (one scalar
``psum``), so when one replica overflows every replica skips the step and backs off the scale. The
gradients are averaged inside the wrapped optimizer. At ``--overflow-step`` one replica gets an input
that overflows float16; the script prints the skipped steps, the scale, and whether the replicas agree.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# XLA_FLAGS must be set before jax is imported, hence the imports below the code above.
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

FEATURES, HIDDEN = 32, 256
AXIS = "batch"


def init_params(rng: np.random.Generator) -> dict:
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN), np.float32) / FEATURES**0.5,
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.standard_normal((HIDDEN, 1), np.float32) / HIDDEN**0.5,
    }


def mlp(params: dict, x: jax.Array) -> jax.Array:
    return (jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"])[:, 0]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jamp.autocast(mlp, dtype=jnp.float16)(params, x) - y) ** 2)


def make_optimizer() -> optax.GradientTransformation:
    average = optax.stateless(lambda grads, _: jax.lax.pmean(grads, AXIS))  # the gradient all-reduce
    return jamp.scaler(optax.chain(average, optax.adam(3e-3)), init_scale=2.0**15, growth_interval=20, axis_name=AXIS)


def make_step(tx: optax.GradientTransformation):
    def step(params, opt_state, x, y):
        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            return jamp.scale(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)  # this replica's scaled grads
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    return jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1))


def batch(rng: np.random.Generator, teacher: dict, replicas: int, per_replica: int = 32):
    """A fresh batch from a fixed teacher network, split into one slice per replica."""
    x = rng.standard_normal((replicas, per_replica, FEATURES), np.float32)
    y = np.tanh(x @ teacher["w1"]) @ teacher["w2"][:, 0]
    return x, y.astype(np.float32)


def replicas_agree(tree) -> bool:
    return all(bool(np.all(np.asarray(leaf) == np.asarray(leaf)[:1])) for leaf in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--overflow-step", type=int, default=25, help="one replica's input overflows float16")
    args = parser.parse_args()

    n = jax.local_device_count()
    rng = np.random.default_rng(0)
    teacher = init_params(rng)
    params = jax.tree.map(lambda a: np.stack([a] * n), init_params(rng))  # one copy per replica
    tx = make_optimizer()
    opt_state = jax.pmap(tx.init)(params)
    step = make_step(tx)
    print(f"{n} replicas on {jax.devices()[0].platform}")

    skipped = []
    for i in range(args.steps):
        x, y = batch(rng, teacher, n)
        if i == args.overflow_step:
            x[n // 2, 0, 0] = 1e5  # inf in float16, on one replica only
        params, opt_state, loss = step(params, opt_state, x, y)
        if bool(jamp.found_inf(opt_state)[0]):
            skipped.append(i)
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss[0]):9.4f}  scale {float(jamp.get_scale(opt_state)[0]):8.0f}")

    print(f"skipped steps: {skipped}")
    print(f"final loss: {float(loss[0]):.4f}")
    print(f"scale: {float(jamp.get_scale(opt_state)[0]):.0f}")
    print(f"replicas agree: {replicas_agree((params, opt_state))}")


if __name__ == "__main__":
    main()
