"""The Flax NNX pattern: autocast the model call, keep the logits layer in float32 by a named scope,
train with ``nnx.Optimizer`` around ``jamp.scaler``. The model is an argument of the autocast function, as of
``nnx.jit``: what a call writes to it (BatchNorm's running statistics, Dropout's RNG count) reaches the model.

    python examples/flax_nnx.py [--steps 100]

It needs flax: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jamp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(32, 128, rngs=rngs)
        self.bn = nnx.BatchNorm(128, rngs=rngs)  # running statistics: written by every training call
        self.drop = nnx.Dropout(0.1, rngs=rngs)  # a new mask each call: its RNG count is written too
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.drop(jax.nn.relu(self.bn(self.hidden(x))))
        # NNX adds no name scopes of its own, so region rules need explicit ones. This one puts the whole
        # norm under the GPU policy's built-in "LayerNorm*" rule (torch's layer_norm runs in float32), the
        # way flax linen's module path does; nnx.LayerNorm computes its statistics in float32 anyway.
        with jax.named_scope("LayerNorm"):
            x = self.norm(x)
        with jax.named_scope("head"):  # our rule below: float32 logits
            return self.head(x)


# torch's CUDA op lists (float16 matmuls; softmax and loss in float32) plus everything under "head" in float32.
POLICY = jamp.get_policy("gpu").with_rules({"head": "float32"})
# The model is an argument: inside nnx.jit and nnx.value_and_grad it is the copy they hand the function, and
# what the call writes to it flows back to the caller's model, as with NNX's own transformations.
amp_call = jamp.autocast(lambda model, x: model(x), policy=POLICY)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(amp_call(model, x), y).mean()


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def scaled_loss(model):  # torch: scaler.scale(loss).backward()
        loss = loss_fn(model, x, y)
        return jamp.scale(loss, optimizer.opt_state), loss

    (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, grads)  # jamp.scaler inside: unscale, skip on inf/NaN, update the scale
    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    steps = parser.parse_args().steps

    x = jax.random.normal(jax.random.key(1), (256, 32))
    y = jnp.argmax(x[:, :10], axis=-1)  # a learnable toy target: the largest of the first ten features
    model = MLP(nnx.Rngs(0))  # parameters stay float32; autocast casts per op
    optimizer = nnx.Optimizer(model, jamp.scaler(optax.adam(1e-3)), wrt=nnx.Param)

    for i in range(steps):
        loss = train_step(model, optimizer, x, y)
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            scale, skipped = jamp.get_scale(optimizer.opt_state), jamp.found_inf(optimizer.opt_state)
            print(f"step {i:4d}  loss {float(loss):.4f}  scale {float(scale):g}  skipped {bool(skipped)}")

    print(
        f"BatchNorm running mean moved to |mean| {float(jnp.abs(model.bn.mean[...]).mean()):.3f} (0 at init); "
        f"Dropout RNG count {int(model.drop.rngs.count[...])} (one per training step)"
    )
    model.eval()  # BatchNorm now normalises with the running statistics written during training; no dropout
    report = jamp.explain(lambda model, x: model(x), policy=POLICY)(model, x)
    for path in sorted({row.path for row in report.rows}):
        ran = {
            d
            for row in report.rows
            if row.path == path and row.rule != "passthrough"  # reshapes: no math
            for d in row.ran_dtypes
            if "float" in d
        }
        print(f"  {path or '(top level)':12s} ran in {', '.join(sorted(ran))}")
    accuracy = jnp.mean(jnp.argmax(amp_call(model, x), -1) == y)
    print(f"RESULT train_accuracy={float(accuracy):.3f}")


if __name__ == "__main__":
    main()
