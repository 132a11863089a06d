"""jamp's precision tools on a transformer block: what ran in which dtype, and where an overflow starts.

python examples/explain.py

It needs flax: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import optax

import jamp
from jamp.tools.sources import short_source


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

    print("1. jamp.explain: what ran in which dtype, under the GPU policy (float16 matmuls), by module path\n")
    report = jamp.explain(Block().apply, device_type="gpu")(params, x)
    print(report)
    dots = [row for row in report.rows if row.primitive == "dot_general"]
    norms = {row.path for row in report.rows if "LayerNorm" in row.path}
    print(
        f"{sum(row.low_precision for row in dots)} of {len(dots)} matmuls ran in float16; "
        f"{' and '.join(sorted(norms))} ran in float32 (the GPU list's LayerNorm rule).\n"
    )

    print("2. jamp.find_overflow: the first op whose float16 result is inf/NaN where float32's is finite.")
    step = jax.value_and_grad(loss_fn)
    print(
        "   Checking the block's forward and backward pass (it compiles the float32 and float16 programs: "
        "a few seconds)..."
    )
    clean = jamp.find_overflow(step, device_type="gpu", min_underflow=1.0)(params, x, labels, Block())
    print(f"   {clean or 'No overflow: every float16 result is finite where float32 is.'}")
    print("   Now with the MLP's activations multiplied by 30000, past float16's largest value (65504)...")
    finding = jamp.find_overflow(step, device_type="gpu", min_underflow=1.0)(
        params, x, labels, Block(activation_gain=3e4)
    )
    print(f"   Found: {finding}")
    if finding is not None:
        print(
            f"   {short_source(finding.source)} is the line to change: scale the activations down there, or "
            "keep that region in float32 with a policy rule."
        )


if __name__ == "__main__":
    main()
