"""Forms NNX users write first, under ``jamp.autocast``, each checked against the same code under ``nnx.jit``
(values, the state the call leaves behind) and for low-precision matmuls in the traced program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import dtypes_of

import jamp

X = jax.random.normal(jax.random.key(0), (32, 8)) + 1.0
AMP_CALL = jamp.autocast(lambda m, x: m(x), device_type="gpu")  # float16
REFERENCE = nnx.jit(lambda m, x: m(x))


class Net(nnx.Module):
    def __init__(self, rngs, rate=0.5):
        self.lin = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.drop(jax.nn.relu(self.bn(self.lin(x))))


def assert_state_like(ours, reference, rtol=2e-2, atol=2e-3):
    """Same variables with the same structure; floats close, integers (RNG counts) and keys equal."""
    ours_flat, ref_flat = nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(reference))
    assert [p for p, _ in ours_flat] == [p for p, _ in ref_flat]
    for (path, a), (_, b) in zip(ours_flat, ref_flat):
        a, b = a.get_value(), b.get_value()
        assert jax.tree.structure(a) == jax.tree.structure(b), path
        for a, b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            assert a.dtype == b.dtype, path
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=str(path))


def state_jaxpr_dtypes(fun, model, *args):
    """``dtypes_of`` for a function of a module: the module's state is an input of the jaxpr."""
    graphdef, state = nnx.split(model)
    return dtypes_of(lambda state, *args: fun(nnx.merge(graphdef, state), *args), state, *args)


class Recorder(nnx.Module):
    """A variable whose value changes structure: a cache filled from None, emptied, or given a new key."""

    def __init__(self, start):
        self.lin = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.seen = nnx.Cache(start)

    def __call__(self, x):
        h = self.lin(x)
        value = self.seen.get_value()
        self.seen.set_value({"last": h, **value} if isinstance(value, dict) else None if value is not None else h)
        return h


@pytest.mark.parametrize(
    "start",
    [None, jnp.ones(()), {"first": jnp.ones(())}],
    ids=["filled from None", "emptied to None", "given a new key"],
)
@pytest.mark.parametrize("form", ["eager", "nnx.jit"])
def test_a_variable_whose_value_changes_structure_is_written_back(start, form):
    ours, reference = Recorder(start), Recorder(start)
    out = (AMP_CALL if form == "eager" else nnx.jit(AMP_CALL))(ours, X)
    REFERENCE(reference, X)
    assert out.dtype == jnp.float32
    assert_state_like(ours, reference)
    assert state_jaxpr_dtypes(AMP_CALL, Recorder(start), X) == [("float16", "float16", "float16")]


class Sower(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.lin(x)
        self.sow(nnx.Intermediate, "hidden", h)
        return h * 2


@pytest.mark.filterwarnings("ignore:.*sow.*")
def test_sown_intermediates_through_nnx_capture_and_the_error_that_names_it():
    out, captured = nnx.capture(AMP_CALL, nnx.Intermediate)(Sower(), X)
    ref_out, ref_captured = nnx.capture(Sower(), nnx.Intermediate)(X)
    (hidden,), (ref_hidden,) = captured["hidden"].get_value(), ref_captured["hidden"].get_value()
    assert hidden.dtype == jnp.float32
    np.testing.assert_allclose(hidden, ref_hidden, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"`Module.sow` adds one.*nnx.capture\(amp_call, nnx.Intermediate\)"):
        jamp.autocast(Sower(), device_type="gpu")(X)


def test_train_and_eval_toggles_between_calls_reach_the_traced_program():
    """``model.eval()`` changes static attributes: each mode is its own trace, as under nnx.jit."""
    traces = {"argument": 0, "module": 0}

    class Counted(Net):  # counts the traces of its calls
        def __init__(self, rngs, form):
            super().__init__(rngs)
            self.form = form

        def __call__(self, x):
            traces[self.form] += 1
            return super().__call__(x)

    by_argument, by_module = Counted(nnx.Rngs(0), "argument"), Counted(nnx.Rngs(0), "module")
    reference = Net(nnx.Rngs(0))
    module_call = jamp.autocast(by_module, device_type="gpu")
    for mode in ("train", "eval", "train", "eval"):
        outs = []
        for model, call in (
            (by_argument, lambda x: AMP_CALL(by_argument, x)),
            (by_module, module_call),
            (reference, lambda x: REFERENCE(reference, x)),
        ):
            getattr(model, mode)()
            outs.append(call(X))
        np.testing.assert_allclose(outs[0], outs[2], rtol=2e-2, atol=1e-2)
        np.testing.assert_allclose(outs[1], outs[2], rtol=2e-2, atol=1e-2)
        assert_state_like(by_argument, reference)
        assert_state_like(by_module, reference)
    assert int(reference.drop.rngs.count[...]) == 2  # dropout drew only in the two training calls
    assert traces == {"argument": 2, "module": 2}  # one trace per mode; a toggle back reuses it


def test_functional_split_merge_with_filters_under_jax_jit():
    """The functional form: ``nnx.split(model, nnx.Param, ...)``, merged inside ``jax.jit``, statistics out."""

    @jax.jit
    def forward(params, rest, x):
        model = nnx.merge(graphdef, params, rest)
        return AMP_CALL(model, x), nnx.state(model, nnx.BatchStat)

    ours, reference = Net(nnx.Rngs(0), rate=0.0), Net(nnx.Rngs(0), rate=0.0)
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
    out, stats = forward(params, rest, X)
    nnx.update(ours, stats)
    np.testing.assert_allclose(out, REFERENCE(reference, X), rtol=2e-2, atol=1e-2)
    assert_state_like(ours, reference)
    assert dtypes_of(forward, params, rest, X) == [("float16", "float16", "float16")]


@nnx.split_rngs(splits=3)
@nnx.vmap(in_axes=0, out_axes=0)
def make_ensemble(rngs):
    return Net(rngs, rate=0.3)


def test_vmap_ensemble_with_batchnorm_and_dropout():
    """The NNX ensemble: members made with split RNG streams, one shared input (``in_axes=(0, None)``)."""

    def ensemble(call):
        return nnx.vmap(call, in_axes=(0, None), out_axes=0)

    ours, reference = make_ensemble(nnx.Rngs(0)), make_ensemble(nnx.Rngs(0))
    out = ensemble(AMP_CALL)(ours, X)
    ref_out = nnx.jit(ensemble(lambda m, x: m(x)))(reference, X)
    assert out.shape == (3, 32, 16) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=1e-2)
    assert list(ours.drop.rngs.count[...]) == [1, 1, 1]
    assert_state_like(ours, reference)
    assert state_jaxpr_dtypes(ensemble(AMP_CALL), ours, X) == [("float16", "float16", "float16")]


def test_attention_decode_cache_advances_under_autocast():
    """``nnx.MultiHeadAttention(decode=True)``: each call writes a step into the float32 key/value cache."""
    ours, reference = (
        nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=True, rngs=nnx.Rngs(0))
        for _ in range(2)
    )
    seq = jax.random.normal(jax.random.key(3), (2, 3, 8))
    for model in (ours, reference):
        model.init_cache(seq.shape)
    for t in range(3):
        out, ref_out = AMP_CALL(ours, seq[:, t : t + 1]), REFERENCE(reference, seq[:, t : t + 1])
        np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=1e-2)
    assert int(ours.cache_index[...]) == 3 and ours.cached_key[...].dtype == jnp.float32
    assert_state_like(ours, reference)
    dots = state_jaxpr_dtypes(AMP_CALL, ours, seq[:, :1])  # projections, scores, weighted values
    assert len(dots) == 6 and all(d[:2] == ("float16", "float16") for d in dots)


def test_nnx_optimizer_around_the_scaler_in_a_float16_train_step():
    """flax's training step with ``jamp.scaler`` inside ``nnx.Optimizer``: ``jamp.scale`` reads the scale from
    the optimizer's state, the statistics and RNG counts move, the loss follows float32's."""
    x = jax.random.normal(jax.random.key(3), (64, 8)) * 2.0 + 1.0
    y = jnp.argmax(x[:, :4], -1)

    @nnx.jit(static_argnames="autocast")
    def train_step(model, optimizer, x, y, autocast):
        def loss(model):
            logits = (AMP_CALL(model, x) if autocast else model(x))[:, :4]
            value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jamp.scale(value, optimizer.opt_state), value

        (_, value), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return value

    runs = {}
    for autocast in (False, True):
        model = Net(nnx.Rngs(params=0, dropout=1), rate=0.1)
        optimizer = nnx.Optimizer(model, jamp.scaler(optax.adamw(1e-2)), wrt=nnx.Param)
        runs[autocast] = [float(train_step(model, optimizer, x, y, autocast)) for _ in range(3)]
        assert float(jamp.get_scale(optimizer.opt_state)) == 2.0**16 and int(optimizer.step[...]) == 3
        assert int(model.drop.rngs.count[...]) == 3 and float(jnp.abs(model.bn.mean[...]).max()) > 0
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-2)
    assert runs[True][-1] < runs[True][0]


def test_a_module_the_function_closes_over_gets_a_hint_to_pass_it_as_an_argument():
    bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match="Cannot mutate") as caught:  # flax's TraceContextError, as under nnx.jit
        jamp.autocast(lambda x: bn(x), device_type="gpu")(X)
    assert any("Pass the module as an argument" in note for note in caught.value.__notes__)
    np.testing.assert_array_equal(bn.mean[...], 0.0)  # and nothing half-written
