"""FSDP-style float16 training with ``jax.jit`` + ``NamedSharding``: nothing distributed to pass to jamp.

    python examples/fsdp_sharded.py [--steps 60] [--overflow-step 25]

Runs on 8 host CPU devices by default (XLA_FLAGS below, unless you set it); on a machine with GPUs or
TPUs the same script shards over every accelerator.

Parameters, gradients and Adam's moments are split over the mesh axis "fsdp" along their first
dimension, and so is the batch. Under ``jit`` the scaler's inf/NaN check is an ordinary reduction, so
XLA's partitioner turns it into a per-shard check plus an all-reduce of one flag: every device takes the
same skip decision, no gradient is all-gathered by the scaler, and the state keeps its sharding. The
script checks both (the compiled HLO of the scaler update, the shardings after training) and prints the
skipped steps and the scale; at ``--overflow-step`` one shard of the batch overflows float16.
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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp

FEATURES, HIDDEN, PER_DEVICE = 64, 256, 16


def init_params(rng: np.random.Generator) -> dict:
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN), np.float32) / FEATURES**0.5,
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.standard_normal((HIDDEN, FEATURES), np.float32) / HIDDEN**0.5,
        "b2": np.zeros(FEATURES, np.float32),
    }


def mlp(params: dict, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jamp.autocast(mlp, dtype=jnp.float16)(params, x) - y) ** 2)


def fsdp_shardings(tree, mesh: jax.sharding.Mesh):
    """Split every leaf whose first dimension divides evenly over the mesh; replicate the rest (scalars)."""
    n = mesh.size

    def sharding(leaf):
        split = leaf.ndim > 0 and leaf.shape[0] % n == 0
        return NamedSharding(mesh, P("fsdp") if split else P())

    return jax.tree.map(sharding, tree)


def make_step(tx: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, x, y):
        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            return jamp.scale(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)  # scaled grads
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def shardings_of(tree) -> list:
    return [leaf.sharding for leaf in jax.tree.leaves(tree)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--overflow-step", type=int, default=25, help="one batch shard overflows float16")
    args = parser.parse_args()

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    teacher = init_params(rng)
    host_params = init_params(rng)
    params = jax.device_put(host_params, fsdp_shardings(host_params, mesh))
    tx = jamp.scaler(optax.adamw(1e-3), init_scale=2.0**15, growth_interval=20)
    opt_state = jax.jit(tx.init, out_shardings=fsdp_shardings(jax.eval_shape(tx.init, params), mesh))(params)
    before = shardings_of((params, opt_state))
    step = make_step(tx)
    data = NamedSharding(mesh, P("fsdp"))
    batch_size = PER_DEVICE * mesh.size
    print(
        f"{mesh.size} devices on {jax.devices()[0].platform}; w1 {params['w1'].sharding.spec}, "
        f"Adam mu[w1] {opt_state.inner_state[0].mu['w1'].sharding.spec}"
    )

    hlo = jax.jit(tx.update).lower(params, opt_state, params).compile().as_text()  # grads shaped as params
    print(f"all-gather in the scaler update: {'all-gather' in hlo}")

    skipped = []
    for i in range(args.steps):
        x = rng.standard_normal((batch_size, FEATURES), np.float32)
        y = np.tanh(x @ teacher["w1"]) @ teacher["w2"]
        if i == args.overflow_step:
            x[-1, 0] = 1e5  # inf in float16, in the last device's shard of the batch only
        params, opt_state, loss = step(params, opt_state, jax.device_put(x, data), jax.device_put(y, data))
        if bool(jamp.found_inf(opt_state)):
            skipped.append(i)
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss):9.4f}  scale {float(jamp.get_scale(opt_state)):8.0f}")

    kept = all(
        a.is_equivalent_to(b, leaf.ndim)
        for a, b, leaf in zip(before, shardings_of((params, opt_state)), jax.tree.leaves((params, opt_state)))
    )
    print(f"skipped steps: {skipped}")
    print(f"final loss: {float(loss):.4f}")
    print(f"scale: {float(jamp.get_scale(opt_state)):.0f}")
    print(f"shardings kept: {kept}")


if __name__ == "__main__":
    main()
