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
        x, _ = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(
            x, None
        )
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
    # every matmul takes low operands; the float32 weights' gradients come out of theirs in float32
    # (jamp.casting.wide_cotangents: as lowered for a GPU; a CPU widens those operands first)
    assert len(dots) > 20 and all(d[:2] == (low, low) and d[2] in (low, "float32") for d in dots)
    assert 0 < sum(d[2] == "float32" for d in dots) < len(dots) / 2
    assert len(convs) >= 2 and all(c == (low,) * 3 for c in convs)


@pytest.mark.parametrize("device_type", ["gpu", "cpu"])
def test_linen_model_grads_match_float32(params, device_type):
    apply = jamp.autocast(Model().apply, device_type=device_type)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(params, TOKENS, apply)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(params, TOKENS, Model().apply)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    scale = max(float(jnp.abs(r).max()) for r in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == r.dtype == jnp.float32
        np.testing.assert_allclose(g, r, atol=0.03 * scale)
    flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])
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
            top_dense = str(e.source_info.name_stack).endswith("Dense_0") and "Block" not in str(
                e.source_info.name_stack
            )
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
    grad = lambda s, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x, y))(s)
    dots = dtypes_of(grad, state, x)
    # 2 forward, 3 backward, all on bfloat16 operands; the backward ones give float32 operands (the weights, the
    # layer norm's float32 output) their gradients in float32 (jamp.casting.wide_cotangents)
    assert len(dots) == 5 and all(d[:2] == ("bfloat16",) * 2 for d in dots)
    assert [d[2] for d in dots] == ["bfloat16"] * 2 + ["float32"] * 3

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


class NNXTrainable(nnx.Module):
    """BatchNorm statistics and a Dropout RNG counter change at every training call."""

    def __init__(self, rngs):
        self.lin1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.lin2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin2(self.drop(jax.nn.relu(self.bn(self.lin1(x)))))

    def features(self, x):
        return self.lin1(x)


def _leaves_equal(a, b):
    def data(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return all(
        np.array_equal(data(u), data(v)) for u, v in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)))
    )


def test_nnx_module_autocast_always_computes_with_todays_weights():
    model = NNXModel(nnx.Rngs(0))
    amp = jamp.autocast(model, dtype="bf16")
    x = jax.random.normal(KEY, (16, 8))
    y = jax.random.normal(jax.random.key(1), (16, 4))
    optimizer = nnx.Optimizer(model, optax.adam(5e-2), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        opt.update(m, grads)

    first = amp(x)
    for _ in range(4):
        step(model, optimizer)
        out, ref = amp(x), model(x)
        assert out.dtype == ref.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)  # bf16 matmuls, today's weights
    assert float(jnp.abs(out - first).max()) > 0.5  # training moved the outputs far beyond that tolerance
    model.lin2.kernel[...] = jnp.ones_like(model.lin2.kernel[...])
    np.testing.assert_allclose(amp(x), model(x), rtol=3e-2, atol=3e-2)
    assert dtypes_of(amp, x) == [("bfloat16",) * 3] * 2


def test_nnx_module_autocast_is_cached_across_weight_updates():
    traces = []

    class Counted(NNXModel):
        def __call__(self, x):
            traces.append(1)
            return super().__call__(x)

    model = Counted(nnx.Rngs(0))
    amp = jamp.autocast(model, dtype="bf16")
    x = jnp.ones((2, 8))
    amp(x)
    model.lin1.kernel[...] = model.lin1.kernel[...] * 2
    amp(x)
    amp(x + 1)
    assert len(traces) == 1


def test_nnx_autocast_writes_back_what_the_call_changes():
    model = NNXTrainable(nnx.Rngs(0))
    reference = nnx.clone(model)
    x = jax.random.normal(KEY, (16, 8))
    jamp.autocast(model, dtype="bf16")(x)
    reference(x)
    for name in ("mean", "var"):
        ours, ref = getattr(model.bn, name)[...], getattr(reference.bn, name)[...]
        assert ours.dtype == jnp.float32 and not np.array_equal(ours, jnp.zeros_like(ours) + (name == "var"))
        np.testing.assert_allclose(ours, ref, rtol=3e-2, atol=3e-2)
    assert int(model.drop.rngs.count[...]) == int(reference.drop.rngs.count[...]) == 1
    # a policy's output dtype is for the outputs, not for the module's variables
    out = jamp.autocast(model, policy="p=f32,c=bf16,o=bf16")(x)
    assert out.dtype == jnp.bfloat16 and model.bn.mean[...].dtype == jnp.float32
    assert int(model.drop.rngs.count[...]) == 2


def test_nnx_bound_method_and_eval_mode():
    model = NNXTrainable(nnx.Rngs(0))
    x = jax.random.normal(KEY, (4, 8))
    features = jamp.autocast(model.features, device_type="gpu")
    assert dtypes_of(features, x) == [("float16",) * 3]
    model.lin1.kernel[...] = jnp.ones_like(model.lin1.kernel[...])
    np.testing.assert_allclose(features(x), model.features(x), rtol=1e-2, atol=1e-2)
    model.eval()  # no statistics update, no RNG use: nothing to write back
    before = nnx.clone(model)
    np.testing.assert_allclose(jamp.autocast(model, dtype="bf16")(x), before(x), rtol=3e-2, atol=3e-2)
    assert _leaves_equal(model, before)


def test_nnx_autocast_inside_nnx_jit_and_grad():
    model = NNXTrainable(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(KEY, (16, 8))
    y = jax.random.normal(jax.random.key(1), (16, 4))

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((jamp.autocast(m, dtype="bf16")(x) - y) ** 2))(m)
        opt.update(m, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(10)]
    assert losses[-1] < losses[0]
    assert int(model.drop.rngs.count[...]) == 10 and model.lin1.kernel[...].dtype == jnp.float32


def test_nnx_module_that_adds_a_variable_is_refused():
    class Lazy(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3, 3)))

        def __call__(self, x):
            self.cache = nnx.Variable(x)
            return x @ self.w

    with pytest.raises(ValueError, match="changed the structure of an NNX module"):
        jamp.autocast(Lazy(), dtype="bf16")(jnp.ones((2, 3)))
