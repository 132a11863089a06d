"""``jamp.nn.dot_product_attention``: jax.nn's attention, traced in the autocast compute dtype."""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
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
