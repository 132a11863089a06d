"""jamp's precision tools on a transformer block: what ran in which dtype, and where an overflow starts.

    python examples/explain.py
"""

from __future__ import annotations

import flax.linen as nn
import jax
import optax

import jamp


class Block(nn.Module):
    """A pre-norm transformer block with a language-model head."""

    dim: int = 32
    activation_gain: float = 1.0  # > 1 injects an overflow into the MLP

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=self.dim)(h, h)
        h = nn.Dense(4 * self.dim, name="mlp_in")(nn.LayerNorm()(x))
        x = x + nn.Dense(self.dim, name="mlp_out")(jax.nn.gelu(h) * self.activation_gain)
        return nn.Dense(64, name="lm_head")(x)


def loss_fn(params, x, labels, block):
    return optax.softmax_cross_entropy_with_integer_labels(block.apply(params, x), labels).mean()


def main():
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    labels = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    params = Block().init(jax.random.key(2), x)

    report = jamp.explain(Block().apply, device_type="gpu")(params, x)
    for row in report.rows:
        if row.primitive == "dot_general":
            print(f"dot_general  {row.path:45s} ran on {', '.join(row.ran_dtypes)}  ({row.rule})")
    print("summary:", {k: round(v, 3) if isinstance(v, float) else v for k, v in report.summary.items()})

    step = jax.value_and_grad(loss_fn)
    clean = jamp.find_overflow(step, device_type="gpu", min_underflow=1.0)(params, x, labels, Block())
    print("clean block, forward and backward:", clean or "no overflow")
    finding = jamp.find_overflow(step, device_type="gpu", min_underflow=1.0)(
        params, x, labels, Block(activation_gain=3e4))
    print("injected overflow:", finding)
    print(f"RESULT explain_rows={len(report.rows)} overflow_at={finding.path if finding else None}")


if __name__ == "__main__":
    main()
