"""The Equinox pattern: a small CNN with BatchNorm on scikit-learn's handwritten digits, trained in float16
autocast with loss scaling, beside the same training in float32.

    pip install -e ".[examples]"          # scikit-learn (the data) and equinox
    python examples/equinox_cnn.py [--steps 300]

* the model and its BatchNorm state (``eqx.nn.State``) go in and out of one autocast loss function, with
  ``eqx.filter_jit`` and ``eqx.filter_value_and_grad`` around it and ``jamp.scale`` inside;
* ``jamp.scaler(optax.adam(...))`` is initialised on ``eqx.filter(model, eqx.is_array)`` and its updates
  applied with ``eqx.apply_updates`` (a skipped step leaves the model as it was, bit for bit);
* for evaluation the module itself is the autocast function: ``jamp.autocast(eqx.nn.inference_mode(model))``.

On a CPU, float16 arithmetic is emulated: the point is the numerics, which follow the same rules on a GPU.
With the default 300 steps both runs reach about 0.98 test accuracy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jamp

BATCH = 64


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    pool: eqx.nn.MaxPool2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.pool = eqx.nn.MaxPool2d(2, stride=2)
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(32 * 4 * 4, 10, key=k3)

    def __call__(self, image: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        """One 1x8x8 image: its logits, and the state with BatchNorm's running statistics updated."""
        h, state = self.norm(self.conv1(image), state)
        h = self.pool(jax.nn.relu(h))
        h = jax.nn.relu(self.conv2(h))
        return self.head(h.ravel()), state


def loss_fn(model: CNN, state: eqx.nn.State, images: jax.Array, labels: jax.Array):
    """Mean cross-entropy of a batch; BatchNorm's statistics are over the batch, the vmap's named axis."""
    logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(images, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def make_step(loss: Callable, tx: optax.GradientTransformation) -> Callable:
    @eqx.filter_jit
    def step(model, state, opt_state, images, labels):
        def scaled_loss(model):  # torch: scaler.scale(loss).backward()
            value, new_state = loss(model, state, images, labels)
            return jamp.scale(value, opt_state), (value, new_state)

        (_, (value, state)), grads = eqx.filter_value_and_grad(scaled_loss, has_aux=True)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, value

    return step


def accuracy(predict: Callable, model: CNN, state: eqx.nn.State, images: jax.Array, labels: jax.Array) -> float:
    """Test accuracy with BatchNorm's running statistics (inference mode)."""
    evaluate = eqx.filter_jit(lambda m, s, x: jax.vmap(predict(m), in_axes=(0, None), out_axes=(0, None))(x, s)[0])
    logits = evaluate(eqx.nn.inference_mode(model), state, images)
    return float(jnp.mean(jnp.argmax(logits, -1) == labels))


def train(name: str, loss: Callable, tx: optax.GradientTransformation, data: tuple, steps: int):
    x_train, y_train = data
    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))  # parameters stay float32
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    step = make_step(loss, tx)
    order = np.random.default_rng(0).permutation(np.arange(steps * BATCH) % len(x_train))  # same batches
    for i in range(steps):
        batch = order[i * BATCH : (i + 1) * BATCH]
        model, state, opt_state, value = step(model, state, opt_state, x_train[batch], y_train[batch])
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            scaled = jamp.get_scale(opt_state), jamp.found_inf(opt_state)
            extra = f"  scale {float(scaled[0]):g}  skipped {bool(scaled[1])}" if name == "amp" else ""
            print(f"{name:5s} step {i:4d}  loss {float(value):.4f}{extra}")
    return model, state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args().steps

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8): Equinox is channels-first
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.25, random_state=0)
    data = (jnp.asarray(x_train), jnp.asarray(y_train))

    amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16; torch's CUDA op lists
    # the float32 run keeps the same code: a disabled scaler's scale() is the identity (torch's enabled=False)
    fp32 = train("fp32", loss_fn, jamp.scaler(optax.adam(3e-3), enabled=False), data, steps)
    amp = train("amp", amp_loss, jamp.scaler(optax.adam(3e-3)), data, steps)

    # which dtypes the ops of each layer ran in: Equinox names each layer's scope (eqx.nn.Conv2d, ...)
    report = jamp.explain(loss_fn, device_type="gpu")(*amp, data[0][:BATCH], data[1][:BATCH])
    for path in sorted({row.path for row in report.rows}):
        rows = [row for row in report.rows if row.path == path and row.rule != "passthrough"]  # reshapes: no math
        ran = {d for row in rows for d in row.ran_dtypes if "float" in d}
        sums = {d for row in rows if row.primitive == "reduce_sum" for d in row.ran_dtypes}
        if ran:
            print(
                f"  {path or '(loss)':16s} ran in {', '.join(sorted(ran))}"
                + (f"; its sums in {', '.join(sorted(sums))}" if sums else "")
            )

    fp32_acc = accuracy(lambda m: m, *fp32, jnp.asarray(x_test), jnp.asarray(y_test))
    amp_acc = accuracy(lambda m: jamp.autocast(m, device_type="gpu"), *amp, jnp.asarray(x_test), jnp.asarray(y_test))
    print(f"RESULT fp32_test_accuracy={fp32_acc:.3f} amp_test_accuracy={amp_acc:.3f}")


if __name__ == "__main__":
    main()
