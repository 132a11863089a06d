"""Fused attention that autocast runs in the compute dtype: ``jamp.nn.dot_product_attention``.

torch's ``scaled_dot_product_attention`` under autocast runs its flash kernel in the autocast dtype, so a
float32 model gets flash attention. JAX's cuDNN kernel refuses float32 while it is traced; wrapped with
:func:`jamp.lower_precision`, the call is traced in the region's compute dtype instead, and the
implementation is picked for the dtype it is traced with: cuDNN's flash attention where the backend is
CUDA and the kernel supports the call (the conditions JAX checks), else XLA's. Outside autocast the same
call runs on the dtypes it is given (a float32 model: XLA's implementation, as ``jax.nn``'s default).
Either way it runs on every backend: XLA's float16 attention asks for a dot algorithm that JAX's lowering
for a CPU refuses, and jamp binds that dot so that each platform gets a form it accepts
(:mod:`jamp.casting.portable_dots`).

The adapters give flax's attention modules (``attention_fn=``) and Equinox's ``MultiheadAttention`` the
same call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting.dtypes import LOW_DTYPES
from jamp.casting.interpreter import run_as_written
from jamp.casting.lower_precision import lower_precision
from jamp.casting.tracing import tracing_depth

jc.hide_from_source_info(__file__)  # an attention call points to the model's line


class _Cuda(NamedTuple):
    cudnn: int  # 91000 for cuDNN 9.10
    capability: tuple[int, int]  # (9, 0) for an H100


def _cuda() -> _Cuda | None:
    """The cuDNN version and the GPU's compute capability where the backend is CUDA with cuDNN, else None."""
    if jax.default_backend() != "gpu":
        return None
    version = jc.cudnn_version()
    if version is None:  # a ROCm GPU
        return None
    major, minor = jax.devices()[0].compute_capability.split(".")
    return _Cuda(version, (int(major), int(minor)))


def _as_4d(shape: tuple) -> tuple:
    return (1,) * (4 - len(shape)) + tuple(shape)


def cudnn_refusal(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
) -> str | None:
    """Why cuDNN's flash attention would refuse this call, or None if it runs it.

    The conditions ``jax.nn.dot_product_attention(implementation="cudnn")`` checks (``check_layout``,
    ``check_is_flash_attention``) for float16/bfloat16 inputs, read off the arguments' shapes and dtypes, the
    backend, the GPU's compute capability and the cuDNN version. A bias or mask needs even sequence lengths
    because the call may be differentiated. :func:`dot_product_attention` asks it when ``implementation`` is
    None. Nothing is computed: the arrays may be tracers.

    Args:
        query (jax.Array): the query, ``[batch, q_length, heads, head_dim]`` (leading axes may be missing).
        key (jax.Array): the key, ``[batch, kv_length, kv_heads, head_dim]``.
        value (jax.Array): the value, ``[batch, kv_length, kv_heads, value_head_dim]``.
        bias (jax.Array | None): None, or a bias of the logits broadcastable to ``[batch, heads, q_length,
            kv_length]``.
        mask (jax.Array | None): None, or a mask of the logits broadcastable to ``[batch, heads, q_length,
            kv_length]``.
        is_causal: whether the attention is causal.
        local_window_size: None, or the local window as an int or a ``(left, right)`` pair, as in
            ``jax.nn.dot_product_attention``.

    Returns:
        A sentence saying why cuDNN would refuse the call, or None when it would run it.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> q = jnp.ones((1, 4, 2, 8), jnp.float16)  # [batch, length, heads, head_dim]
        >>> jamp.nn.cudnn_refusal(q, q, q)  # on a CPU; None on a CUDA GPU with cuDNN
        'the backend is not CUDA with cuDNN'
    """
    cuda = _cuda()
    if cuda is None:
        return "the backend is not CUDA with cuDNN"
    dtypes = {np.dtype(x.dtype) for x in (query, key, value)}
    if len(dtypes) > 1 or dtypes.pop() not in LOW_DTYPES:
        return "cuDNN takes float16 or bfloat16 query, key and value of one dtype"
    _, t, _, head = _as_4d(query.shape)
    _, s, _, value_head = _as_4d(value.shape)
    max_head = 256 if cuda.capability >= (9, 0) else 128
    if head % 8 or head > max_head:
        return f"the head dimension must be a multiple of 8 and at most {max_head}, got {head}"
    if head != value_head and (cuda.cudnn < 91000 or cuda.capability < (9, 0)):
        return "a value head dimension other than the query's needs cuDNN 9.10 and a Hopper GPU"
    if cuda.capability == (10, 3) and cuda.cudnn < 91100:
        return "compute capability 10.3 needs cuDNN 9.11"
    masks = [_as_4d(x.shape) for x in (bias, mask) if x is not None]
    if masks:
        if np.broadcast_shapes(*masks)[-2:] != (t, s):
            return "cuDNN takes a bias or mask that spans the query and key lengths (no broadcasting there)"
        if t % 2 or s % 2:
            return "cuDNN's backward pass with a bias or mask needs even sequence lengths"
    if local_window_size is not None:
        right = local_window_size if isinstance(local_window_size, int) else local_window_size[1]
        if right and not is_causal:
            return "cuDNN's local window has no right part unless the attention is causal"
    return None


_STATIC = ("scale", "is_causal", "local_window_size", "implementation", "return_residual")


@lower_precision
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention`` (same arguments and result), run in the autocast compute dtype.

    Under ``jamp.autocast``, the floating inputs are cast to the region's compute dtype before the call
    is traced (:func:`jamp.lower_precision`), so cuDNN's flash attention runs for a float32 model.
    ``implementation=None`` picks ``"cudnn"`` where the backend is CUDA and cuDNN supports the call in the
    dtype it is traced with (:func:`cudnn_refusal` says why not), else ``"xla"``; an explicit
    ``implementation`` is passed on as given. Outside autocast the call runs on the dtypes it is given. A dot
    whose algorithm a platform refuses (float16 logits on a CPU) runs there in a form it accepts.

    Args:
        query: the query, ``[batch, q_length, heads, head_dim]`` or ``[q_length, heads, head_dim]``.
        key: the key, ``[batch, kv_length, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``
            (grouped-query attention).
        value: the value, shaped like ``key``.
        bias: None, or a bias added to the logits, broadcastable to ``[batch, heads, q_length, kv_length]``.
        mask: None, or a boolean mask broadcastable to ``[batch, heads, q_length, kv_length]``: True attends.
        scale: the logits' scale; None means ``1 / sqrt(head_dim)``.
        is_causal: apply a causal mask.
        query_seq_lengths: None, or the valid query length of each batch element (int32 ``[batch]``).
        key_value_seq_lengths: None, or the valid key/value length of each batch element (int32 ``[batch]``).
        local_window_size: None, or a local window as an int (left and right) or a ``(left, right)`` pair.
        implementation: None (pick as above), "xla" or "cudnn".
        return_residual: also return the softmax's logsumexp residual, as ``jax.nn`` does.

    Returns:
        The attention output, shaped like ``query``, in the dtype the call ran in (under autocast the
        region's compute dtype, as a matmul's output); with ``return_residual`` the pair ``(output,
        residual)``.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> q = jnp.ones((1, 4, 2, 8))  # [batch, length, heads, head_dim], float32
        >>> attention = jamp.autocast(jamp.nn.dot_product_attention, device_type="gpu")
        >>> out = attention(q, q, q)  # float16: cuDNN's flash attention on a CUDA GPU
        >>> out.shape, out.dtype  # the float32 function's output
        ((1, 4, 2, 8), dtype('float32'))
    """
    if implementation is None:
        refused = cudnn_refusal(query, key, value, bias, mask, is_causal=is_causal, local_window_size=local_window_size)
        implementation = "xla" if refused else "cudnn"
    static = dict(
        scale=scale,
        is_causal=is_causal,
        local_window_size=local_window_size if local_window_size is None else _pair_or_int(local_window_size),
        implementation=implementation,
        return_residual=return_residual,
    )
    lengths = dict(query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    if tracing_depth():  # autocast's interpreter binds the call, each dot portably
        return jax.nn.dot_product_attention(query, key, value, bias, mask, **lengths, **static)
    return _as_written(query, key, value, bias, mask, lengths, **static)


def _pair_or_int(size: Any) -> int | tuple:
    """A window size as a static argument of a jit: hashable (a list given for the pair becomes a tuple)."""
    return size if isinstance(size, int) else tuple(size)


@functools.partial(jax.jit, static_argnames=_STATIC, inline=jc.INLINE_WHILE_TRACING)
def _as_written(query, key, value, bias, mask, lengths: dict, **static) -> Any:
    """``jax.nn.dot_product_attention`` outside autocast, where its dots may name an algorithm a platform
    refuses (float16 logits: ``F16_F16_F32``, which JAX's lowering for CPU refuses): they run there in a form
    it accepts (:func:`jamp.casting.interpreter.run_as_written`). Traced once per signature (then inlined
    into an enclosing trace, and compiled once when called eagerly)."""
    call = functools.partial(jax.nn.dot_product_attention, **static)
    return run_as_written(call, query, key, value, bias, mask, **lengths)


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


__all__ = ["cudnn_refusal", "dot_product_attention", "equinox_multihead_attention", "flax_dot_product_attention"]
