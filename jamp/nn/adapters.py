"""flax's ``attention_fn`` and Equinox's ``MultiheadAttention`` calling :func:`jamp.nn.dot_product_attention`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _jax_compat as jc
from jamp.nn.attention import dot_product_attention

jc.hide_from_source_info(__file__)  # an attention call points to the model's line


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(f"jamp.nn: {message}")


def _merged_batch(x: jax.Array | None, batch: tuple) -> jax.Array | None:
    """``x`` ([batch..., a, b, c], leading dims broadcastable to ``batch``) as [prod(batch), a, b, c]."""
    if x is None:
        return None
    x = jnp.reshape(x, (1,) * (3 - x.ndim) + x.shape) if x.ndim < 3 else x
    x = jnp.broadcast_to(x, batch + x.shape[-3:])
    return jnp.reshape(x, (math.prod(batch), *x.shape[-3:]))


def flax_dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable | None = None,
    qk_attn_weights_einsum: Callable | None = None,
    attn_weights_value_einsum: Callable | None = None,
    is_causal: bool = False,
) -> jax.Array:
    """:func:`dot_product_attention` with flax's ``attention_fn`` signature.

    For ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` and
    ``flax.nnx.MultiHeadAttention(attention_fn=...)``.

    Inputs are ``[batch..., length, heads, head_dim]``; a ``mask`` (True attends, any dtype) and a
    ``bias`` broadcast to ``[batch..., heads, q_length, kv_length]``; ``dtype`` promotes query, key and
    value as flax does. A fused kernel never forms the attention weights, so dropout on them
    (``dropout_rate > 0`` and not ``deterministic``), sowing them (``module``) and custom einsums are
    refused with a ValueError. ``precision`` is not applied (flax's own ``dot_product_attention`` drops it
    too when it calls ``jax.nn.dot_product_attention``) and ``force_fp32_for_softmax`` always holds: both
    implementations compute the softmax in float32.

    Args:
        query: the query, ``[batch..., q_length, heads, head_dim]``.
        key: the key, ``[batch..., kv_length, heads, head_dim]``.
        value: the value, ``[batch..., kv_length, heads, head_dim]``.
        bias: None, or a bias broadcastable to ``[batch..., heads, q_length, kv_length]``.
        mask: None, or a mask broadcastable to ``[batch..., heads, q_length, kv_length]`` (True, or nonzero,
            attends).
        broadcast_dropout: ignored (there is no dropout).
        dropout_rng: ignored (there is no dropout).
        dropout_rate: must be 0 unless ``deterministic``.
        deterministic: True allows any ``dropout_rate`` (none is applied).
        dtype: the dtype query, key and value are promoted to; None means their result type.
        precision: ignored.
        module: must be None (the weights cannot be sown).
        force_fp32_for_softmax: ignored: the softmax always runs in float32.
        einsum_dot_general: must be None.
        qk_attn_weights_einsum: must be None.
        attn_weights_value_einsum: must be None.
        is_causal: apply a causal mask.

    Returns:
        The attention output, ``[batch..., q_length, heads, head_dim]``.

    Raises:
        ValueError: for dropout on the attention weights, ``module`` or a custom einsum.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> q = jnp.ones((2, 3, 4, 2, 8))  # two batch axes, length 4, 2 heads of size 8
        >>> jamp.nn.flax_dot_product_attention(q, q, q).shape
        (2, 3, 4, 2, 8)

        In a flax model: ``nnx.MultiHeadAttention(..., attention_fn=jamp.nn.flax_dot_product_attention)``.
    """
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    _refuse(
        dropout_rate > 0 and not deterministic,
        f"dropout_rate={dropout_rate} with deterministic=False asks for dropout on the attention weights, "
        "which fused attention never forms; use dropout_rate=0 (or deterministic=True), or flax's "
        "dot_product_attention",
    )
    _refuse(
        module is not None,
        "sowing the attention weights (module=, sow_weights=True) needs the weights, which fused attention never forms",
    )
    for name, value_ in (
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        _refuse(value_ is not None, f"{name} replaces an einsum that fused attention does not have; pass None")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    mask = None if mask is None else jnp.asarray(mask).astype(bool)
    shape = query.shape
    if query.ndim > 4:  # jax.nn takes one batch dimension
        batch = shape[:-3]
        query, key, value, bias, mask = (_merged_batch(x, batch) for x in (query, key, value, bias, mask))
    out = dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    return jnp.reshape(out, shape[:-1] + out.shape[-1:])


def equinox_multihead_attention(
    attention: Any,
    query: jax.Array,
    key_: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    inference: bool | None = None,
    process_heads: Callable | None = None,
) -> jax.Array:
    """An ``equinox.nn.MultiheadAttention`` call whose heads fused attention computes.

    ``attention(query, key_, value, mask)`` for an ``equinox.nn.MultiheadAttention``, with its heads
    computed by :func:`dot_product_attention` (Equinox's module has no ``attention_fn`` to swap).

    Same arguments as the module's ``__call__``: unbatched ``[length, size]`` inputs, a boolean ``mask`` of
    shape ``[q_length, kv_length]`` or ``[heads, q_length, kv_length]``. Query/key and value heads of
    different sizes (``qk_size != vo_size``) are zero-padded to one size for the kernel. Dropout on the
    attention weights (the module's ``dropout.p > 0`` outside inference) is refused with a ValueError:
    fused attention never forms the weights.

    Args:
        attention: the ``equinox.nn.MultiheadAttention`` whose projections are used.
        query: the query, ``[q_length, query_size]``.
        key_: the key, ``[kv_length, key_size]`` (the module's ``key_`` argument).
        value: the value, ``[kv_length, value_size]``.
        mask: None, or a boolean mask ``[q_length, kv_length]`` or ``[heads, q_length, kv_length]``: True
            attends.
        key: the module's PRNG key for dropout; unused, as dropout is refused.
        inference: None takes the module's ``dropout.inference``; True allows a module with dropout.
        process_heads: None, or a function of the query, key and value heads (each ``[length, heads,
            head_size]``) returning them changed but not reshaped (rotary embeddings), as Equinox's.

    Returns:
        The module's output, ``[q_length, output_size]``.

    Raises:
        ValueError: for dropout on the attention weights, or a ``process_heads`` that changes a shape.

    Examples:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jamp
        >>> key = jax.random.key(0)
        >>> mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=key)
        >>> x = jnp.ones((4, 8))  # [length, size]
        >>> jamp.nn.equinox_multihead_attention(mha, x, x, x).shape
        (4, 8)
    """
    del key
    inference = attention.dropout.inference if inference is None else inference
    _refuse(
        attention.dropout.p > 0 and not inference,
        f"the module's dropout (p={attention.dropout.p}) acts on the attention weights, which fused attention "
        "never forms; call it with inference=True, or call the module itself",
    )
    heads = [
        jax.vmap(proj)(x).reshape(x.shape[0], attention.num_heads, -1)
        for proj, x in ((attention.query_proj, query), (attention.key_proj, key_), (attention.value_proj, value))
    ]
    if process_heads is not None:
        shapes = [h.shape for h in heads]
        heads = list(process_heads(*heads))
        _refuse([h.shape for h in heads] != shapes, "process_heads must not change the shape of the heads")
    out = _attention_of_head_sizes(*heads, mask=None if mask is None else mask.astype(bool))
    return jax.vmap(attention.output_proj)(out.reshape(query.shape[0], -1))


def _attention_of_head_sizes(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None) -> jax.Array:
    """:func:`dot_product_attention` where the value heads may be narrower or wider than the query and key
    heads (Equinox's ``qk_size != vo_size``; jax.nn takes one head size): the narrower side is padded
    with zeros, which changes neither the logits nor the attended values, and the logits keep the scale
    of the query heads' size."""
    qk_size, vo_size = query.shape[-1], value.shape[-1]
    if qk_size == vo_size:
        return dot_product_attention(query, key, value, mask=mask)
    size = max(qk_size, vo_size)
    query, key, value = (jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])]) for x in (query, key, value))
    out = dot_product_attention(query, key, value, mask=mask, scale=1 / math.sqrt(qk_size))
    return out[..., :vo_size]
