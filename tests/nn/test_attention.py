"""jamp.nn: fused attention in the autocast compute dtype, for float32 models (jax.nn, flax linen/NNX,
Equinox).

On this CPU-only machine, cuDNN's path is checked as far as JAX goes without a GPU: JAX asks for the cuDNN
version while it traces the call (``check_cudnn_version``), so the tests stand in a version for it (the
``cuda_host`` fixture); then the call traces and lowers for the CUDA platform, and the lowered program
shows the cuDNN custom calls (forward and backward) and their operand dtypes. Whether cuDNN compiles and
runs them, their numbers and their speed need a GPU.

jamp and JAX cache traces per function and input types, not per backend (which never changes in a real
process), so each test that stands in a CUDA host uses shapes no other test traces attention with.
"""

import re
import types

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import eqns, lower_for_cuda
from jax._src.cudnn import fused_attention_stablehlo

import jamp
import jamp.nn.attention as jamp_nn


def _qkv(shape, seed=0):
    return tuple(jax.random.normal(k, shape) for k in jax.random.split(jax.random.key(seed), 3))


@pytest.fixture
def cuda_host(monkeypatch):
    """What jamp.nn and JAX read about the GPU, as on an H100 with cuDNN 9.10."""
    monkeypatch.setattr(
        fused_attention_stablehlo, "cuda_versions", types.SimpleNamespace(cudnn_get_version=lambda: 91000)
    )
    monkeypatch.setattr(jamp_nn, "_cuda", lambda: jamp_nn._Cuda(91000, (9, 0)))


def _cudnn_calls(fn, *args) -> dict:
    """ "forward"/"backward" -> the dtypes of the operands of cuDNN's fused attention (``__cudnn$fmha...``
    custom calls; ``fmhaScaleBiasSoftmax`` with a mask or bias) in ``fn`` lowered for CUDA."""
    text = lower_for_cuda(fn, *args).as_text()
    calls = re.findall(r"stablehlo\.custom_call @__cudnn\$fmha(\w+?)\(.*?\).*?: \((.*?)\) ->", text)
    return {
        "backward" if target.endswith("Backward") else "forward": sorted(set(re.findall(r"x(bf16|f16|f32)>", ops)))
        for target, ops in calls
    }


@pytest.mark.parametrize("dtype,low", [("bf16", "bf16"), ("f16", "f16")])
def test_float32_model_lowers_to_cudnn_flash_attention_under_autocast(cuda_host, dtype, low):
    q, k, v = _qkv((2, 16, 2, 32))
    loss = jamp.autocast(
        lambda q, k, v: jnp.square(jamp.nn.dot_product_attention(q, k, v, is_causal=True)).sum(), dtype=dtype
    )
    calls = _cudnn_calls(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v)
    # q, k, v (and the output and its cotangent backward) in the compute dtype; the softmax statistics float32
    assert calls["forward"] == [low]
    assert calls["backward"] == sorted([low, "f32"])


def test_outside_autocast_the_float32_call_runs_as_written(cuda_host):
    q, k, v = _qkv((2, 16, 2, 40))
    picked = jax.make_jaxpr(jamp.nn.dot_product_attention)(q, k, v)  # float32: XLA's, as jax.nn's default
    assert not any("dot_product_attention_fwd" in e.primitive.name for e in eqns(picked))
    with pytest.raises(NotImplementedError, match="Q must be fp16/bf16"):
        jamp.nn.dot_product_attention(q, k, v, implementation="cudnn")
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert _cudnn_calls(jamp.nn.dot_product_attention, *low) == {"forward": ["bf16"]}


def test_an_explicit_implementation_is_honoured_under_autocast(cuda_host):
    q, k, v = _qkv((2, 8, 2, 48))
    closed = jax.make_jaxpr(
        jamp.autocast(lambda q, k, v: jamp.nn.dot_product_attention(q, k, v, implementation="xla"), dtype="bf16")
    )(q, k, v)
    assert not any("dot_product_attention_fwd" in e.primitive.name for e in eqns(closed))


def test_cpu_runs_xla_attention_with_low_precision_matmuls_and_float32_logits():
    q, k, v = _qkv((2, 8, 2, 16))
    amp = jamp.autocast(lambda q, k, v: jamp.nn.dot_product_attention(q, k, v, is_causal=True), dtype="bf16")
    expected = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    np.testing.assert_allclose(amp(q, k, v), expected, atol=0.03)
    dots = [
        (tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype))
        for e in eqns(jax.make_jaxpr(amp)(q, k, v))
        if e.primitive.name == "dot_general"
    ]
    assert dots == [(("bfloat16", "bfloat16"), "float32"), (("bfloat16", "bfloat16"), "bfloat16")]
    assert _attention_jits(jax.make_jaxpr(amp)(q, k, v)) == [["bfloat16"] * 3]


def test_backward_attention_matmuls_run_in_the_compute_dtype():
    """The logits matmul returns float32 (jax.nn asks for it); its transposes multiply the logits'
    gradient in bfloat16, not float32 x bfloat16 (which XLA runs as a float32 matmul)."""
    q, k, v = _qkv((2, 8, 2, 16))
    amp = jamp.autocast(lambda q, k, v: jnp.sum(jamp.nn.dot_product_attention(q, k, v) ** 2), dtype="bf16")
    saving_dots = jamp.autocast(
        jax.checkpoint(
            lambda q, k, v: jnp.sum(jamp.nn.dot_product_attention(q, k, v) ** 2),
            policy=jax.checkpoint_policies.dots_saveable,
        ),
        dtype="bf16",
    )
    for f in (amp, saving_dots):  # a remat policy that saves dots keeps the logits: computed once
        dots = [
            (tuple(str(x.aval.dtype) for x in e.invars), str(e.outvars[0].aval.dtype))
            for e in eqns(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
            if e.primitive.name == "dot_general"
        ]
        assert sorted(dots) == sorted(
            [(("bfloat16", "bfloat16"), "float32")] + [(("bfloat16", "bfloat16"), "bfloat16")] * 5
        )
    reference = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v) ** 2), argnums=(0, 1, 2))(
        q, k, v
    )
    forward_mode = jax.jacfwd(amp, argnums=(0, 1, 2))(q, k, v)  # forward-mode differentiation too
    for g, f, r in zip(jax.grad(amp, argnums=(0, 1, 2))(q, k, v), forward_mode, reference):
        np.testing.assert_allclose(g, r, atol=0.03 * float(jnp.abs(r).max()))
        np.testing.assert_allclose(f, r, atol=0.03 * float(jnp.abs(r).max()))


def _second_order(implementation):
    """The gradient of a gradient norm (a gradient penalty) through the attention, under autocast."""

    def loss(q, k, v):
        return jnp.sum(jamp.nn.dot_product_attention(q, k, v, implementation=implementation) ** 2)

    amp = jamp.autocast(loss, dtype="bf16")
    return jax.grad(lambda q, k, v: jnp.sum(jax.grad(amp)(q, k, v) ** 2))


def test_second_derivative_on_cpu_and_xla_on_a_cuda_host(request):
    """A second derivative through the recorded call (XLA's implementation on a CPU); on a CUDA host
    cuDNN's kernel, picked by default, has none, and implementation="xla" (as the docs say) gives one."""
    q, k, v = _qkv((2, 8, 2, 16))
    reference = jax.grad(
        lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(q, k, v) ** 2))(q) ** 2)
    )(q)
    np.testing.assert_allclose(_second_order(None)(q, k, v), reference, atol=0.03 * float(jnp.abs(reference).max()))
    request.getfixturevalue("cuda_host")
    q, k, v = _qkv((2, 8, 2, 56))  # shapes no other test traces attention with
    with pytest.raises(NotImplementedError, match="dot_product_attention_fwd_wrapper"):
        jax.make_jaxpr(_second_order(None))(q, k, v)
    assert _cudnn_calls(_second_order("xla"), q, k, v) == {}


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


QKV = (_spec((2, 16, 4, 64)),) * 3
REFUSALS = {
    "supported": (QKV, {}, None),
    "causal window": (QKV, {"is_causal": True, "local_window_size": (4, 4)}, None),
    "full mask": (QKV, {"mask": _spec((2, 1, 16, 16), jnp.bool_)}, None),
    "float32": ((_spec((2, 16, 4, 64), jnp.float32),) * 3, {}, "float16 or bfloat16"),
    "mixed dtypes": ((QKV[0], QKV[1], _spec((2, 16, 4, 64), jnp.float16)), {}, "of one dtype"),
    "head dim": ((_spec((2, 16, 4, 20)),) * 3, {}, "multiple of 8 and at most 256, got 20"),
    "head dim before Hopper": ((_spec((2, 16, 4, 192)),) * 3, {"capability": (8, 0)}, "at most 128, got 192"),
    "value head dim": ((QKV[0], QKV[1], _spec((2, 16, 4, 32))), {"cudnn": 90800}, "value head dimension"),
    "broadcast mask": (QKV, {"mask": _spec((2, 1, 1, 16), jnp.bool_)}, "spans the query and key lengths"),
    "odd length": ((_spec((2, 15, 4, 64)),) * 3, {"bias": _spec((1, 4, 15, 15))}, "even sequence lengths"),
    "right window": (QKV, {"local_window_size": (4, 4)}, "no right part"),
    "no cuda": (QKV, {"cuda": None}, "not CUDA"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_cudnn_refusal_reads_jax_conditions(monkeypatch, case):
    (q, k, v), kwargs, reason = REFUSALS[case]
    kwargs = dict(kwargs)
    cuda = kwargs.pop("cuda", jamp_nn._Cuda(kwargs.pop("cudnn", 91000), kwargs.pop("capability", (9, 0))))
    monkeypatch.setattr(jamp_nn, "_cuda", lambda: cuda)
    refused = jamp.nn.cudnn_refusal(q, k, v, **kwargs)
    assert refused is None if reason is None else reason in refused


# -- flax and Equinox ----------------------------------------------------------------------------------


def _attention_jits(closed) -> list:
    return [
        [str(v.aval.dtype) for v in e.invars]
        for e in eqns(closed)
        if e.primitive.name == "jit" and e.params["name"] == "dot_product_attention"
    ]


def _linen(shape, attention_fn=jamp.nn.flax_dot_product_attention):
    x = jax.random.normal(jax.random.key(0), shape)
    mask = nn.make_causal_mask(x[..., 0])  # float32 ones and zeros, as flax makes them
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=shape[-1], attention_fn=attention_fn)
    return module, jax.jit(module.init)(jax.random.key(1), x, x, mask=mask), x, mask


def test_linen_attention_module_with_float32_params():
    module, params, x, mask = _linen((2, 8, 16))
    reference = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)  # flax's own attention
    expected = jax.jit(lambda p, x, mask: reference.apply(p, x, x, mask=mask))(params, x, mask)
    np.testing.assert_allclose(
        jax.jit(lambda p, x, mask: module.apply(p, x, x, mask=mask))(params, x, mask), expected, atol=1e-5
    )
    amp = jamp.autocast(lambda p, x, mask: module.apply(p, x, x, mask=mask), dtype="bf16")
    np.testing.assert_allclose(amp(params, x, mask), expected, atol=0.05)
    assert _attention_jits(jax.make_jaxpr(amp)(params, x, mask)) == [["bfloat16"] * 3 + ["bool"]]


def test_linen_attention_module_lowers_to_cudnn(cuda_host):
    module, params, x, mask = _linen((2, 8, 48))
    amp = jamp.autocast(lambda p, x, mask: module.apply(p, x, x, mask=mask).sum(), dtype="bf16")
    assert _cudnn_calls(jax.grad(amp), params, x, mask) == {"forward": ["bf16"], "backward": ["bf16", "f32"]}


def _nnx(features, attention_fn=jamp.nn.flax_dot_product_attention):
    return nnx.MultiHeadAttention(
        num_heads=2,
        in_features=features,
        qkv_features=features,
        decode=False,
        attention_fn=attention_fn,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize("cuda", [False, True])
def test_nnx_attention_module_with_float32_params(request, cuda):
    features = 32 if cuda else 16
    if cuda:
        request.getfixturevalue("cuda_host")
    module, reference = _nnx(features), _nnx(features, nnx.dot_product_attention)
    x = jax.random.normal(jax.random.key(0), (2, 8, features))
    amp = jamp.autocast(module, dtype="bf16")
    closed = jax.make_jaxpr(lambda x: amp(x))(x)
    assert _attention_jits(closed) == [["bfloat16"] * 3]
    fused = [e for e in eqns(closed) if e.primitive.name == "dot_product_attention_fwd_wrapper"]
    assert [[str(v.aval.dtype) for v in e.invars[:3]] for e in fused] == ([["bfloat16"] * 3] if cuda else [])
    if not cuda:
        np.testing.assert_allclose(module(x), reference(x), atol=1e-5)
        np.testing.assert_allclose(amp(x), reference(x), atol=0.05)


def test_equinox_multihead_attention_with_float32_params():
    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    mask = jnp.tril(jnp.ones((8, 8), bool))
    expected = eqx.filter_jit(lambda mha, x: mha(x, x, x, mask))(mha, x)
    fused = eqx.filter_jit(lambda mha, x: jamp.nn.equinox_multihead_attention(mha, x, x, x, mask))(mha, x)
    np.testing.assert_allclose(fused, expected, atol=1e-5)
    amp = jamp.autocast(lambda mha, x: jamp.nn.equinox_multihead_attention(mha, x, x, x, mask), dtype="bf16")
    np.testing.assert_allclose(amp(mha, x), expected, atol=0.05)
    assert _attention_jits(jax.make_jaxpr(lambda x: amp(mha, x))(x)) == [["bfloat16"] * 3 + ["bool"]]


@pytest.mark.parametrize("qk_size,vo_size", [(8, 24), (24, 8)])
def test_equinox_query_key_and_value_heads_of_different_sizes(qk_size, vo_size):
    """Equinox allows qk_size != vo_size (torch's SDPA too); jax.nn's attention takes one head size."""
    mha = eqx.nn.MultiheadAttention(
        num_heads=2,
        query_size=16,
        key_size=12,
        value_size=20,
        output_size=16,
        qk_size=qk_size,
        vo_size=vo_size,
        key=jax.random.key(0),
    )
    q, k, v = (
        jax.random.normal(key, (n, d))
        for key, n, d in zip(jax.random.split(jax.random.key(1), 3), (8, 6, 6), (16, 12, 20))
    )
    mask = jnp.ones((8, 6), bool).at[:, 4:].set(False)
    expected = eqx.filter_jit(lambda mha: mha(q, k, v, mask))(mha)
    fused = eqx.filter_jit(lambda mha: jamp.nn.equinox_multihead_attention(mha, q, k, v, mask))(mha)
    np.testing.assert_allclose(fused, expected, atol=1e-5)
    amp = jamp.autocast(lambda mha: jamp.nn.equinox_multihead_attention(mha, q, k, v, mask), dtype="bf16")
    np.testing.assert_allclose(amp(mha), expected, atol=0.05)


def test_equinox_dropout_on_the_weights_is_refused_outside_inference():
    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, dropout_p=0.1, key=jax.random.key(0))
    x = jnp.ones((4, 16))
    with pytest.raises(ValueError, match=r"dropout \(p=0.1\) acts on the attention weights"):
        jamp.nn.equinox_multihead_attention(mha, x, x, x, key=jax.random.key(1))
    fused, expected = (
        eqx.filter_jit(f)(mha, x)
        for f in (
            lambda mha, x: jamp.nn.equinox_multihead_attention(mha, x, x, x, inference=True),
            lambda mha, x: mha(x, x, x, inference=True),
        )
    )
    np.testing.assert_allclose(fused, expected, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dropout_rate": 0.1}, "dropout_rate=0.1 with deterministic=False"),
        ({"module": object()}, "sowing the attention weights"),
        ({"qk_attn_weights_einsum": jnp.einsum}, "qk_attn_weights_einsum replaces an einsum"),
    ],
)
def test_flax_adapter_refuses_what_fused_attention_cannot_do(kwargs, match):
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=match):
        jamp.nn.flax_dot_product_attention(q, q, q, **kwargs)


def test_flax_adapter_takes_several_batch_dimensions_and_dtype():
    q, k, v = _qkv((3, 2, 8, 2, 16))
    mask = jnp.tril(jnp.ones((8, 8)))[None, None, None]  # broadcast over both batch dimensions and the heads
    out = jax.jit(lambda q, k, v: jamp.nn.flax_dot_product_attention(q, k, v, mask=mask, dtype=jnp.bfloat16))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        out, jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask))(q, k, v), atol=0.03
    )
