"""jamp quickstart: train a small MLP classifier under autocast and show which ops ran in which dtype.

    python examples/quickstart.py
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

import jamp


def init_mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) * (2 / m) ** 0.5, "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y, model=jamp.autocast(mlp, device_type="gpu")):  # float16 matmuls, CUDA op lists
    logits = model(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(model, params, inputs, labels, steps=60):
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, labels, model)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    accuracy = float(jnp.mean(jnp.argmax(mlp(params, inputs), -1) == labels))
    return losses, accuracy


def op_mix(fun, *args):
    """Count (primitive, output dtype) over every equation, sub-jaxprs included."""
    counts = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.outvars and hasattr(eqn.outvars[0].aval, "dtype"):
                counts[(eqn.primitive.name, str(eqn.outvars[0].aval.dtype))] += 1
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fun)(*args).jaxpr)
    return counts


def main():
    key_params, key_data = jax.random.split(jax.random.key(0))
    params = init_mlp(key_params, [32, 128, 128, 10])
    centers = jax.random.normal(key_data, (10, 32)) * 0.4
    labels = jax.random.randint(key_data, (1024,), 0, 10)
    inputs = centers[labels] + jax.random.normal(jax.random.key(1), (1024, 32))

    amp_losses, amp_acc = train(jamp.autocast(mlp, device_type="gpu"), params, inputs, labels)
    ref_losses, ref_acc = train(mlp, params, inputs, labels)
    print("step   float32 loss   autocast(float16) loss")
    for i in range(0, 60, 10):
        print(f"{i:4d}   {ref_losses[i]:12.4f}   {amp_losses[i]:12.4f}")
    print(f"train accuracy: float32 {ref_acc:.3f}, autocast {amp_acc:.3f}")

    print("\nops of one training step (forward + backward) by output dtype:")
    mix = op_mix(jax.grad(loss_fn), params, inputs, labels)
    for prim in ("dot_general", "add", "max", "exp", "log", "reduce_sum", "convert_element_type"):
        row = {d: n for (p, d), n in mix.items() if p == prim}
        print(f"  {prim:22s} " + "  ".join(f"{d}: {n}" for d, n in sorted(row.items())))
    grads = jax.grad(loss_fn)(params, inputs, labels)
    print("gradient dtypes:", sorted({str(g.dtype) for g in jax.tree.leaves(grads)}))


if __name__ == "__main__":
    main()
