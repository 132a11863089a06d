"""The Flax linen pattern: autocast ``model.apply``, keep one module in float32 by its path, scale the loss.

python examples/flax_linen.py [--steps 100]

It needs flax: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jamp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(nn.LayerNorm()(x)))
        return nn.Dense(10, name="head")(x)  # the module path rule below matches "head"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    steps = parser.parse_args().steps

    x = jax.random.normal(jax.random.key(1), (256, 32))
    y = jnp.argmax(x[:, :10], axis=-1)  # a learnable toy target: the largest of the first ten features
    model = MLP()
    params = model.init(jax.random.key(0), x)  # parameters stay float32; autocast casts per op

    # torch's CUDA op lists (float16 matmuls, LayerNorm/softmax/loss in float32), plus the logits layer
    # in float32: patterns match flax module paths such as "head" or "Dense_1".
    policy = jamp.get_policy("gpu").with_rules({"head": "float32"})
    apply = jamp.autocast(model.apply, policy=policy)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    tx = jamp.scaler(optax.adam(1e-3))  # GradScaler: wraps the optimizer it guards
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def scaled_loss(p):  # torch: scaler.scale(loss).backward()
            loss = loss_fn(p, x, y)
            return jamp.scale(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # unscale, skip on inf/NaN, update the scale
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            print(
                f"step {i:4d}  loss {float(loss):.4f}  scale {float(jamp.get_scale(opt_state)):g}  "
                f"skipped {bool(jamp.found_inf(opt_state))}"
            )

    report = jamp.explain(model.apply, policy=policy)(params, x)  # which op ran in which dtype, where
    for path in sorted({row.path for row in report.rows}):
        ran = {
            d
            for row in report.rows
            if row.path == path and row.rule != "passthrough"  # reshapes: no math
            for d in row.ran_dtypes
            if "float" in d
        }
        print(f"  {path:16s} ran in {', '.join(sorted(ran))}")
    accuracy = jnp.mean(jnp.argmax(apply(params, x), -1) == y)
    print(f"RESULT train_accuracy={float(accuracy):.3f}")


if __name__ == "__main__":
    main()
