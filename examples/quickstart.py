"""jamp quickstart: both halves of torch.amp, autocast and GradScaler, training a small MLP classifier.

    python examples/quickstart.py

``jamp.autocast`` runs the matmuls in float16 with torch's CUDA op lists (a policy is chosen by name and
runs on any machine, a CPU included), and ``jamp.scaler`` wraps the optimizer as torch's GradScaler does:
the loss is scaled before differentiation, and each update unscales the gradients, skips the step if they
overflowed and moves the scale. The float32 run uses the same training step with the scaler disabled
(torch's ``GradScaler(enabled=False)``).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax

import jamp

STEPS = 60


def init_mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) * (2 / m) ** 0.5, "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def train(loss, tx, params, inputs, labels):
    """``STEPS`` full-batch steps of ``loss`` with ``tx``; the losses, the final state and the skipped steps.

    The loop reads the loss every step, and the scaler with it: ``jamp.scaler_summary`` gives the scale and the
    skip counts as Python numbers, and warns (``jamp.SkippedStepsWarning``) if steps keep being skipped."""
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def scaled_loss(p):
            value = loss(p, inputs, labels)
            return jamp.scale(value, opt_state), value  # differentiate the scaled loss, keep the loss

        (_, value), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)  # scaled gradients
        updates, opt_state = tx.update(grads, opt_state, params)  # unscale, check, step or skip, new scale
        return optax.apply_updates(params, updates), opt_state, value

    losses, skipped = [], 0
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
        skipped += jamp.scaler_summary(opt_state)["found_inf"]  # this step was skipped
    accuracy = float(jnp.mean(jnp.argmax(mlp(params, inputs), -1) == labels))
    return losses, accuracy, opt_state, skipped


def ran_in(report, primitive):
    """'float16: 8' for the rows of ``primitive``: how many ran on each floating input dtype."""
    counts = collections.Counter(
        ", ".join(sorted({d for d in r.ran_dtypes if "float" in d})) for r in report.rows if r.primitive == primitive
    )
    return "  ".join(f"{dtype}: {n}" for dtype, n in sorted(counts.items()))


def main():
    key_params, key_data = jax.random.split(jax.random.key(0))
    params = init_mlp(key_params, [32, 128, 128, 10])
    centers = jax.random.normal(key_data, (10, 32)) * 0.4
    labels = jax.random.randint(key_data, (1024,), 0, 10)
    inputs = centers[labels] + jax.random.normal(jax.random.key(1), (1024, 32))

    amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16 matmuls, torch's CUDA op lists
    ref_losses, ref_acc, _, _ = train(loss_fn, jamp.scaler(optax.adam(3e-3), enabled=False), params, inputs, labels)
    amp_losses, amp_acc, amp_state, skipped = train(amp_loss, jamp.scaler(optax.adam(3e-3)), params, inputs, labels)

    print("training loss, float32 beside float16 autocast + jamp.scaler, from the same initial parameters:")
    print("step   float32   float16 AMP")
    for i in range(0, STEPS, 10):
        print(f"{i:4d}   {ref_losses[i]:7.4f}   {amp_losses[i]:11.4f}")
    print(f"train accuracy: float32 {ref_acc:.3f}, float16 AMP {amp_acc:.3f}")
    summary = jamp.scaler_summary(amp_state)  # the scale and skip counts, as Python numbers
    print(f"loss scale: 65536 -> {summary['scale']:.0f}, {skipped} of {STEPS} steps skipped")
    print(
        "A good result: the two loss columns fall together and agree to about three decimals, the accuracies\n"
        "match, and few steps are skipped (a skip is a step whose float16 gradients overflowed at the current\n"
        "scale: the scaler drops it and halves the scale). Columns that drift apart or show nan mean an op ran\n"
        "in too narrow a dtype; jamp.find_overflow(amp_loss)(params, x, y) names the first one."
    )

    print("\nwhat one training step (forward + backward) ran in, from jamp.explain:")
    report = jamp.explain(jax.grad(loss_fn), device_type="gpu")(params, inputs, labels)
    for primitive in ("dot_general", "add", "exp", "log", "reduce_sum"):
        print(f"  {primitive:12s} {ran_in(report, primitive)}")
    print("The matmuls (dot_general) ran in float16, the softmax cross-entropy's exp, log and sums in float32.")
    grads = jax.grad(amp_loss)(params, inputs, labels)
    print("gradient dtypes:", sorted({str(g.dtype) for g in jax.tree.leaves(grads)}))


if __name__ == "__main__":
    main()
