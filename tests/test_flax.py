"""autocast on real Flax models: linen (Dense, Conv, LayerNorm, attention, nn.remat, nn.scan) and NNX."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import dtypes_of, eqns

import jamp

KEY = jax.random.key(0)


class Block(nn.Module):
    dim: int = 16

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.dim)(h, h)
        x = x + h
        h = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(jax.nn.gelu(h))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        x = nn.Conv(16, (3,), padding="SAME")(x)
        x = nn.remat(Block)()(x)
        x, _ = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(x, None)
        return nn.Dense(32)(nn.LayerNorm()(x))


TOKENS = jax.random.randint(KEY, (2, 8), 0, 32)


def loss_fn(params, tokens, apply):
    logits = apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


@pytest.fixture(scope="module")
def params():
    return Model().init(KEY, TOKENS)


@pytest.mark.parametrize("device_type,low", [("gpu", "float16"), ("cpu", "bfloat16")])
def test_linen_model_matmuls_and_convs_low_forward_and_backward(params, device_type, low):
    apply = jamp.autocast(Model().apply, device_type=device_type)
    grad_fn = jax.grad(functools.partial(loss_fn, apply=apply))
    dots = dtypes_of(grad_fn, params, TOKENS)
    convs = dtypes_of(grad_fn, params, TOKENS, primitive="conv_general_dilated")
    assert len(dots) > 20 and all(d == (low,) * 3 for d in dots)
    assert len(convs) >= 2 and all(c == (low,) * 3 for c in convs)


@pytest.mark.parametrize("device_type", ["gpu", "cpu"])
def test_linen_model_grads_match_float32(params, device_type):
    apply = jamp.autocast(Model().apply, device_type=device_type)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(params, TOKENS, apply)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, TOKENS, Model().apply)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    scale = max(float(jnp.abs(r).max()) for r in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == r.dtype == jnp.float32
        np.testing.assert_allclose(g, r, atol=0.03 * scale)
    flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])  # noqa: E731
    cosine = jnp.dot(flat(grads), flat(ref_grads)) / (jnp.linalg.norm(flat(grads)) * jnp.linalg.norm(flat(ref_grads)))
    assert cosine > 0.999


def test_linen_training_steps_reduce_loss(params):
    apply = jamp.autocast(Model().apply, dtype="bf16")
    tx = optax.adam(1e-2)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p, TOKENS, apply)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p, s = params, tx.init(params)
    losses = [float(step(p, s)[2])]
    for _ in range(20):
        p, s, loss = step(p, s)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_linen_module_path_rule_keeps_lm_head_in_float32(params):
    policy = jamp.get_policy("cpu").with_rules({"Dense_*": "float32"})
    closed = jax.make_jaxpr(jamp.autocast(Model().apply, policy=policy))(params, TOKENS)
    for e in eqns(closed):
        if e.primitive.name == "dot_general":
            top_dense = str(e.source_info.name_stack).endswith("Dense_0") and "Block" not in str(e.source_info.name_stack)
            if top_dense:
                assert all(str(v.aval.dtype) == "float32" for v in e.invars)


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.lin1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.lin2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin2(jax.nn.relu(self.norm(self.lin1(x))))


def test_nnx_model_with_autocast_and_optimizer():
    model = NNXModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(KEY, (16, 8))
    y = jax.random.normal(KEY, (16, 4))

    def loss(m, x, y):
        pred = jamp.autocast(lambda m, x: m(x), dtype="bf16")(m, x)
        return jnp.mean((pred - y) ** 2)

    graphdef, state = nnx.split(model)
    dots = dtypes_of(lambda s, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x, y))(s), state, x)
    assert len(dots) == 5 and all(d == ("bfloat16",) * 3 for d in dots)  # 2 forward, 3 backward

    @nnx.jit
    def step(m, opt, x, y):
        value, grads = nnx.value_and_grad(loss)(m, x, y)
        opt.update(m, grads)
        return value

    losses = [float(step(model, optimizer, x, y)) for _ in range(15)]
    assert losses[-1] < losses[0]
    assert model.lin1.kernel[...].dtype == jnp.float32


def test_nnx_split_merge_functional_style():
    model = NNXModel(nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    apply = jamp.autocast(lambda s, x: nnx.merge(graphdef, s)(x), device_type="gpu")
    x = jnp.ones((2, 8))
    np.testing.assert_allclose(apply(state, x), model(x), rtol=2e-2, atol=2e-2)
    assert dtypes_of(apply, state, x)[0] == ("float16",) * 3
