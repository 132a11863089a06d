"""The public autocast API: call forms, caching (no retrace, no recompile), static args, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dtypes_of

import jamp

BF16, F16, F32 = "bfloat16", "float16", "float32"
W = jnp.ones((8, 8)) / 8
X = jnp.ones((4, 8))


def test_call_forms():
    def f(w, x):
        return x @ w

    @jamp.autocast
    def g(w, x):
        return x @ w

    @jamp.autocast(dtype=jnp.bfloat16)
    def h(w, x):
        return x @ w

    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, X) == [(BF16,) * 3]
    assert dtypes_of(h, W, X) == [(BF16,) * 3]
    # no device_type: the default backend's policy (cpu and tpu: bfloat16; gpu: float16)
    assert dtypes_of(g, W, X)[0][0] == (F16 if jax.default_backend() == "gpu" else BF16)
    assert g.__name__ == "g" and h.__wrapped__ is not None


def test_outputs_keep_declared_dtypes_unless_policy_says_otherwise():
    f = lambda w, x: x @ w
    assert jamp.autocast(f, dtype="bf16")(W, X).dtype == jnp.float32
    policy = jamp.get_policy("p=f32,c=bf16,o=bf16")
    assert jamp.autocast(f, policy=policy)(W, X).dtype == jnp.bfloat16


def test_no_retrace_and_no_recompile_on_repeated_calls():
    traces = []

    def f(w, x):
        traces.append(1)
        return jnp.tanh(x @ jax.jit(lambda a: a * 2)(w)).sum()

    g = jamp.autocast(f, dtype="bf16")
    g(W, X)
    for _ in range(3):
        g(W, X + 1)
    assert len(traces) == 1
    jitted = jax.jit(g)
    jitted(W, X)
    n = len(traces)
    jitted(W, X + 1)
    assert len(traces) == n
    g(W, X[:2])  # a new shape traces once more
    assert len(traces) == n + 1


def test_no_recompile_counted_by_jax():
    from jax._src import test_util as jtu

    g = jamp.autocast(lambda w, x: jax.jit(jnp.tanh)(x @ w).sum(), dtype="bf16")
    g(W, X)
    inputs = [X * i for i in range(3)]
    with jtu.count_jit_and_pmap_lowerings() as count:
        for x in inputs:
            g(W, x)
    assert count() == 0


def test_python_scalars_and_strings_are_static():
    def f(w, x, train, mode="a", scale=2.0):
        h = x @ w
        if train and mode == "a":
            h = h * scale
        return h.sum()

    g = jamp.autocast(f, dtype="bf16")
    assert float(g(W, X, True)) == pytest.approx(float(f(W, X, True)), rel=1e-2)
    assert float(g(W, X, False, mode="b")) == pytest.approx(float(f(W, X, False)), rel=1e-2)


def test_python_floats_are_traced_once_weak_typed_as_under_jit():
    traces = []

    def f(w, x, lr, opts):
        traces.append(1)
        return (x @ w).sum() * lr + opts["momentum"]

    g = jamp.autocast(f, dtype="bf16")
    total = float((X @ W).sum())
    for i in range(100):
        lr = 0.01 * (i + 1)
        assert float(g(W, X, lr, {"momentum": 1.0 - lr})) == pytest.approx(total * lr + 1.0 - lr, rel=1e-2)
    assert len(traces) == 1
    closed = jax.make_jaxpr(g)(W, X, 0.5, {"momentum": 0.5})
    assert [(str(v.aval.dtype), v.aval.weak_type) for v in closed.jaxpr.invars[2:]] == [("float32", True)] * 2
    assert dtypes_of(g, W, X, 0.5, {"momentum": 0.5}) == [(BF16,) * 3]
    # as under jax.jit: a weak-typed float does not promote a bf16 result
    h = jamp.autocast(lambda w, x, s: x @ w * s, policy="p=f32,c=bf16,o=bf16")
    assert h(W, X, 2.0).dtype == jax.jit(lambda x, s: x * s)(X.astype(jnp.bfloat16), 2.0).dtype == jnp.bfloat16


def test_bools_ints_and_strings_stay_static():
    def f(x, n, flag, mode):
        for _ in range(n):  # an int sizes a loop, a bool and a str pick branches
            x = x * 2 if flag and mode == "double" else x
        return jnp.zeros((n,)) + x.sum()

    g = jamp.autocast(f, dtype="bf16")
    assert g(X, 3, True, "double").shape == (3,)
    assert float(g(X, 2, True, "double")[0]) == float(X.sum() * 4)
    assert float(g(X, 2, False, "double")[0]) == float(X.sum())


def test_traced_float_in_python_control_flow_names_the_argument():
    def f(x, rate):
        return x * 0 if rate > 0.5 else x

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jamp.autocast(f, dtype="bf16")(X, 0.7)
    assert "dynamic[1] is rate" in str(info.value.__notes__) and "static_argnames" in str(info.value.__notes__)
    assert float(jamp.autocast(f, dtype="bf16", static_argnames="rate")(X, rate=0.7).sum()) == 0


def _call_each(fun, calls):
    for args in calls:
        fun(*args)


def test_a_static_value_that_keeps_changing_warns_once_naming_it():
    def f(w, x, step, cfg):
        return (x @ w).sum() + step + cfg["depth"]

    g = jamp.autocast(f, dtype="bf16")
    with pytest.warns(UserWarning) as record:
        _call_each(g, [(W, X, step, {"depth": 2}) for step in range(40)])
    messages = [str(r.message) for r in record if "jamp.autocast" in str(r.message)]
    assert len(messages) == 1
    assert "traced the same array shapes and dtypes 17 times because the argument step changed 16 times" in messages[0]
    assert "jnp.asarray" in messages[0]
    # a nested static leaf is named by its path; an unhashable one is called so
    g2 = jamp.autocast(lambda w, x, sizes: (x @ w).sum() * len(sizes), dtype="bf16", static_argnums=2)
    with pytest.warns(UserWarning, match=r"the argument sizes is not hashable \(\[1, 2\]\), so no trace"):
        _call_each(g2, [(W, X, [1, 2])] * 20)
    g3 = jamp.autocast(f, dtype="bf16")
    with pytest.warns(UserWarning, match=r"argument cfg\['depth'\] changed"):
        _call_each(g3, [(W, X, jnp.int32(0), {"depth": depth}) for depth in range(20)])


def test_a_few_static_values_do_not_warn():
    import warnings

    g = jamp.autocast(lambda x, train: x * 2 if train else x, dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(100):
            g(X, i % 2 == 0)


def test_static_argnums_for_array_valued_arguments():
    def f(w, x, n):
        return (x @ w).sum() * int(n)

    g = jamp.autocast(f, dtype="bf16", static_argnums=2)
    assert float(g(W, X, 3)) == pytest.approx(float(f(W, X, 3)), rel=1e-2)
    g2 = jamp.autocast(lambda w, x, *, k: (x @ w).sum() * k, dtype="bf16", static_argnames="k")
    assert float(g2(W, X, k=2)) == pytest.approx(2 * float((X @ W).sum()), rel=1e-2)


def test_pytree_inputs_and_outputs():
    def f(params, batch):
        h = batch["x"] @ params["w"]
        return {"logits": h, "aux": (h.sum(), None)}

    out = jamp.autocast(f, dtype="bf16")({"w": W}, {"x": X})
    assert out["aux"][1] is None and out["logits"].shape == (4, 8)


@pytest.mark.parametrize("bad", [jnp.float32, jnp.float64, jnp.int8, "fp8", "bfloat", 3])
def test_bad_dtype(bad):
    with pytest.raises(ValueError, match=r"dtype=.*allowed: bfloat16, float16"):
        jamp.autocast(lambda x: x, dtype=bad)


@pytest.mark.parametrize("bad", ["xpu", "GPU0", 3, "not a real device"])
def test_bad_device_type(bad):
    with pytest.raises(ValueError, match=r"device_type=.*allowed"):
        jamp.autocast(lambda x: x, device_type=bad)


@pytest.mark.parametrize("bad", [None, 3, "string", jnp.ones(3)])
def test_non_callable(bad):
    if bad is None:
        assert callable(jamp.autocast(bad))  # decorator factory
        return
    with pytest.raises(TypeError, match="requires a callable"):
        jamp.autocast(bad)


@pytest.mark.parametrize(
    "bad,match",
    [
        ("p=f32,x=bf16", "cannot parse"),
        ("c=f64", "allowed"),
        ("c=float32", "no mixed precision"),
        ("compute=int8", "allowed"),
        (42, "policy must be"),
    ],
)
def test_bad_policy(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jamp.autocast(lambda x: x, policy=bad)


def test_bad_region_mode_and_category():
    with pytest.raises(ValueError, match="region mode"):
        jamp.get_policy("gpu").with_rules({"*": "fp32"})
    with pytest.raises(ValueError, match="categories"):
        jamp.get_policy("gpu").with_categories({"exp": "sometimes"})


@pytest.mark.parametrize(
    "spec,device,compute,output",
    [
        ("gpu", "gpu", F16, None),
        ("cuda", "gpu", F16, None),
        ("cpu", "cpu", BF16, None),
        ("tpu", "tpu", BF16, None),
        ("mixed_float16", "gpu", F16, None),
        ("mixed_bfloat16", "cpu", BF16, None),
        ("bf16", "cpu", BF16, None),
        ("p=f32,c=bf16,o=f32", "cpu", BF16, F32),
        ("params=float32,compute=float16,output=float16,device=gpu", "gpu", F16, F16),
        ("compute=bf16, d=tpu", "tpu", BF16, None),
    ],
)
def test_policy_strings(spec, device, compute, output):
    p = jamp.get_policy(spec)
    assert (p.device_type, str(p.compute_dtype), getattr(p.output_dtype, "name", None)) == (device, compute, output)
    assert hash(p) == hash(jamp.get_policy(spec)) and p == jamp.get_policy(spec)


def test_policy_is_a_valid_jit_static_argument_and_casts_trees():
    p = jamp.get_policy("p=f32,c=bf16,o=f16")
    out = jax.jit(lambda x, policy: policy.cast_to_output(x), static_argnums=1)(X, p)
    assert out.dtype == jnp.float16
    tree = p.cast_to_compute({"a": X, "i": jnp.arange(3), "d": np.float64(1.0)})
    assert tree["a"].dtype == jnp.bfloat16 and tree["i"].dtype == jnp.int32


def test_creates_no_arrays_and_no_backend_at_import_or_construction():
    from helpers import run_subprocess

    out = run_subprocess(
        """
        import jax, jax._src.xla_bridge as xb, optax
        import jamp
        g = jamp.autocast(lambda x: x * 2)
        tx = jamp.scaler(optax.adam(1e-3), init_scale=3.0, growth_factor=1.1, backoff_factor=0.3)
        policy = jamp.get_policy("p=f32,c=bf16,o=f32,d=gpu")
        print(len(xb._backends))
    """,
        devices=1,
    )
    assert out.strip() == "0"
