"""autocast on Equinox models: modules as the function, eqx.filter_* transformations around autocast
functions, eqx.nn.State (BatchNorm), MultiheadAttention, jamp.scaler with eqx.apply_updates."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import eqns

import jamp

X = jax.random.normal(jax.random.key(1), (4, 8))
TRACES = []  # one entry per time a Counted module is traced


class Counted(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, x):
        TRACES.append(1)
        return jax.vmap(self.mlp)(x)

    def hidden(self, x):  # Equinox wraps every method but __call__ as a module of its own
        return jax.vmap(self.mlp.layers[0])(x)


def _arrays(tree) -> list:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _bitwise_equal(a, b) -> bool:
    return all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_module_as_the_function_takes_its_arrays_as_inputs_and_shares_one_cache(compilations):
    model = Counted(eqx.nn.MLP(8, 3, 16, 2, key=jax.random.key(0)))
    trained = jax.tree.map(lambda a: 2 * a if eqx.is_array(a) else a, model)  # what an optimizer step makes
    ref, ref_trained = model(X), trained(X)
    amp = jamp.autocast(model, dtype="bf16")
    closed, _ = amp.rewrite(X)
    assert not closed.consts and len(closed.jaxpr.invars) == len(_arrays(model)) + 1  # weights are inputs
    # the matmuls of float32 weights: wide_matmul, the two operands it multiplies in bfloat16
    matmuls = [e for e in eqns(closed) if e.primitive.name == "wide_matmul"]
    assert [tuple(str(v.aval.dtype) for v in e.invars[:2]) for e in matmuls] == [("bfloat16", "bfloat16")] * 3
    TRACES.clear()
    np.testing.assert_allclose(amp(X), ref, rtol=0.02, atol=0.02)

    # a new module: a new autocast of it computes with its weights, from the same trace
    np.testing.assert_allclose(jamp.autocast(trained, dtype="bf16")(X), ref_trained, rtol=0.02, atol=0.05)
    np.testing.assert_allclose(jamp.autocast(trained.__call__, dtype="bf16")(X), ref_trained, rtol=0.02, atol=0.05)
    assert len(TRACES) == 1
    np.testing.assert_allclose(jamp.autocast(trained.hidden, dtype="bf16")(X), trained.hidden(X), rtol=0.02, atol=0.05)
    assert jamp.autocast(model, dtype="bf16", enabled=False)(X).tolist() == model(X).tolist()

    # the autocast is a pytree of the module's leaves, so eqx.filter_jit traces the weights
    assert _bitwise_equal(_arrays(amp), _arrays(model))
    run = eqx.filter_jit(lambda f, x: f(x))
    compilations.clear()
    np.testing.assert_allclose(run(amp, X), amp(X), rtol=1e-6)
    np.testing.assert_allclose(run(jamp.autocast(trained, dtype="bf16"), X), ref_trained, rtol=0.02, atol=0.05)
    assert len(compilations) == 1


class Gate(eqx.Module):
    rate: float  # a plain float field, used in Python below

    def __call__(self, x, *, key=None):
        return x * self.rate if self.rate > 0 else x


def test_module_fields_that_are_not_arrays_stay_static_as_under_filter_jit():
    """MaxPool2d's ``-inf`` init and a float used in Python: traced like a float argument, the first would
    have no gradient rule and the second would not run."""
    key = jax.random.key(2)
    cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 4, 3, key=key),
            eqx.nn.MaxPool2d(2, stride=2),
            Gate(0.5),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(36, 3, key=key),
        ]
    )
    images = jax.random.normal(key, (1, 8, 8))
    loss = lambda model, x: jnp.sum(model(x) ** 2)
    grads = eqx.filter_jit(eqx.filter_grad(jamp.autocast(loss, dtype="bf16")))(cnn, images)
    ref = eqx.filter_jit(eqx.filter_grad(loss))(cnn, images)
    assert {str(g.dtype) for g in _arrays(grads)} == {"float32"}
    for g, r in zip(_arrays(grads), _arrays(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=0.05, atol=0.05 * float(jnp.abs(r).max()))
    convs = [
        r.ran_dtypes
        for r in jamp.explain(loss, dtype="bf16")(cnn, images).rows
        if r.primitive == "conv_general_dilated"
    ]
    assert convs == [("bfloat16", "bfloat16")]


class Net(eqx.Module):
    """A convolution, a BatchNorm in training mode (its state: running statistics and a first-call flag),
    self-attention over the pixels, a linear head."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    attention: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")
        self.attention = eqx.nn.MultiheadAttention(2, 4, key=k2)
        self.head = eqx.nn.Linear(4, 3, key=k3)

    def __call__(self, x, state):
        h, state = self.norm(jax.nn.relu(self.conv(x)), state)
        pixels = h.reshape(4, -1).T
        return self.head(self.attention(pixels, pixels, pixels).mean(0)), state


def batch_loss(model, state, x, y):
    logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def test_training_with_batchnorm_state_attention_and_the_scaler():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 1, 8, 8)) * 2 + 1
    y = jnp.arange(8) % 3
    amp_loss = jamp.autocast(batch_loss, device_type="gpu")  # float16, torch's CUDA op lists
    tx = jamp.scaler(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, opt_state):
        def scaled(model):
            loss, new_state = amp_loss(model, state, x, y)
            return jamp.scale(loss, opt_state), (loss, new_state)

        (_, (loss, state)), grads = eqx.filter_value_and_grad(scaled, has_aux=True)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss, grads

    reference = eqx.filter_jit(eqx.filter_value_and_grad(batch_loss, has_aux=True))  # float32 throughout
    (ref_loss, ref_state), ref_grads = reference(model, state, x, y)
    new_model, new_state, new_opt_state, loss, grads = step(model, state, opt_state)
    # the state comes out as declared (the literal `False` flag a bool array, the statistics float32)
    assert jax.tree.map(lambda a: str(a.dtype), jax.tree.leaves(new_state)) == ["bool", "float32", "float32"]
    assert not new_state.get(model.norm.ema_first_time_index)
    for s, r in zip(jax.tree.leaves(new_state)[1:], jax.tree.leaves(ref_state)[1:], strict=True):
        np.testing.assert_allclose(s, r, rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(loss, ref_loss, rtol=5e-3)
    # the module as the function, state in and out, under the vmap that names BatchNorm's axis
    per_example = eqx.filter_vmap(
        jamp.autocast(model, device_type="gpu"), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    _, module_state = eqx.filter_jit(per_example)(x, state)
    assert jax.tree.structure(module_state) == jax.tree.structure(new_state)
    for s, r in zip(jax.tree.leaves(module_state), jax.tree.leaves(new_state), strict=True):
        assert s.dtype == r.dtype
        np.testing.assert_allclose(s, r, rtol=1e-3, atol=1e-3)
    scale = float(jamp.get_scale(opt_state))
    assert {str(g.dtype) for g in _arrays(grads)} == {"float32"}  # the params' dtype
    for g, r in zip(_arrays(grads), _arrays(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g) / scale, r, rtol=0.05, atol=0.05 * float(jnp.abs(r).max()))

    losses = [float(loss)]
    for _ in range(2):
        new_model, new_state, new_opt_state, loss, _ = step(new_model, new_state, new_opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] and not jamp.found_inf(new_opt_state)

    # a scale so large that float16 gradients overflow: the step is skipped, bit for bit
    huge = jamp.set_scale(new_opt_state, 2.0**100)
    skipped_model, _, skipped_opt_state, _, _ = step(new_model, new_state, huge)
    assert jamp.found_inf(skipped_opt_state)
    assert _bitwise_equal(_arrays(skipped_model), _arrays(new_model))
    assert _bitwise_equal(skipped_opt_state.inner_state, huge.inner_state)

    # inside: matmuls and the convolution in float16, and their bias adds (Linear transposes under vmap and
    # Conv squeezes before adding, the bias rule looks through that); the statistics and softmax in float32
    report = jamp.explain(batch_loss, device_type="gpu")(model, state, x, y)
    ran = {
        (r.primitive, r.ran_dtypes)
        for r in report.rows
        if r.primitive in ("dot_general", "conv_general_dilated", "reduce_sum", "exp")
    }
    assert ran == {
        ("dot_general", ("float16", "float16")),
        ("conv_general_dilated", ("float16", "float16")),
        ("reduce_sum", ("float32",)),
        ("exp", ("float32",)),
    }
    bias_adds = [r for r in report.rows if r.primitive == "add" and r.path.endswith(("eqx.nn.Linear", "eqx.nn.Conv"))]
    assert len(bias_adds) == 2 and all(r.ran_dtypes == ("float16", "float16") for r in bias_adds)


def test_norm_layers_run_in_float32_on_the_gpu_policy():
    """torch's layer_norm/rms_norm/group_norm are float32 ops on the CUDA list; Equinox builds them from
    primitives under the name scope eqx.nn.<class>. Unruled, RMSNorm's x ** 2 overflowed float16 past 256."""
    key = jax.random.key(3)
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(8, 16, key=key), eqx.nn.RMSNorm(16), eqx.nn.LayerNorm(16), eqx.nn.GroupNorm(4, 16)]
    )
    x = 300 * X
    f = lambda model, x: jax.vmap(model)(x)
    np.testing.assert_allclose(
        jamp.autocast(f, device_type="gpu")(model, x), eqx.filter_jit(f)(model, x), rtol=0.02, atol=0.02
    )
    rows = jamp.explain(f, device_type="gpu")(model, x).rows
    for norm in ("eqx.nn.RMSNorm", "eqx.nn.LayerNorm", "eqx.nn.GroupNorm"):
        inside = [r for r in rows if norm in r.path.split("/")]
        assert inside and all(r.mode == "float32" and "float16" not in r.ran_dtypes for r in inside), norm
