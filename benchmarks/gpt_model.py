"""The decoder-only transformer both model benchmarks train (autocast_overhead.py, train_throughput.py).

A flax linen GPT: token and position embeddings, pre-LayerNorm blocks (causal self-attention, gelu
MLP), a final LayerNorm and an lm_head tied to the embedding or not. ``config`` needs ``layers``,
``d_model``, ``heads``, ``d_mlp``, ``vocab``, ``seq`` and ``tied``; ``dtype`` is flax's hand cast.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention, then a gelu MLP."""

    config: Any
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        c = self.config
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(c.heads, dtype=self.dtype, name="attn")(h, mask=mask)
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(nn.Dense(c.d_mlp, dtype=self.dtype, name="mlp_in")(h))
        return x + nn.Dense(c.d_model, dtype=self.dtype, name="mlp_out")(h)


class Decoder(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final LayerNorm, lm_head (tied or untied)."""

    config: Any
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        embed = nn.Embed(c.vocab, c.d_model, dtype=self.dtype, name="embed")
        positions = nn.Embed(c.seq, c.d_model, dtype=self.dtype, name="pos_embed")(jnp.arange(tokens.shape[-1]))
        x = embed(tokens) + positions
        mask = nn.make_causal_mask(tokens, dtype=jnp.bool_)
        for i in range(c.layers):
            x = Block(c, self.dtype, name=f"layers_{i}")(x, mask)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return embed.attend(x) if c.tied else nn.Dense(c.vocab, dtype=self.dtype, name="lm_head")(x)
