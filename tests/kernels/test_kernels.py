"""unscale_and_check on one CPU device: every backend against a NumPy reference of torch's kernel."""

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_flags import as_users
from helpers import eqns, lower_for_cuda

import jamp_kernels
from jamp_kernels import pallas_triton, xla

SIZES = (1, 7, 1000, 4097, 8192, 65537)  # 8192: several full blocks, no ragged tail
DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
BACKENDS = ("xla", "interpret", "auto")
INV = np.float32(1 / 3)  # not a power of two, so every product is rounded


def reference(leaf, inv):
    """torch's _amp_foreach_non_finite_check_and_unscale_ for one half/single leaf, in NumPy (float64:
    test_kernels_subprocess.py)."""
    x = np.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.floating) or inv == 1:
        return x
    return (x.astype(np.float32) * np.float32(inv)).astype(x.dtype)


def assert_same_bits(got, want):
    """Bit equality, except that any NaN matches any NaN (multiplication may requiet a payload)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.issubdtype(got.dtype, np.integer) or got.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
        return
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    bits = f"u{got.dtype.itemsize}"
    np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))


@pytest.fixture(scope="module")
def tree():
    """Every ragged size in every half/single dtype, a 0-d leaf, an N-d leaf, and pass-through leaves."""
    rng = np.random.default_rng(0)
    tree = {f"{jnp.dtype(dt).name}_{n}": jnp.asarray(rng.standard_normal(n) * 1024, dt) for dt in DTYPES for n in SIZES}
    tree.update(
        scalar=jnp.float16(-3.5),
        matrix=jnp.asarray(rng.standard_normal((33, 5)), jnp.bfloat16),
        steps=jnp.arange(5, dtype=jnp.int32),
        mask=jnp.array([True, False]),
        empty=jnp.zeros((0, 3)),
    )
    return tree


@pytest.fixture(scope="module")
def jitted():
    return {b: jax.jit(lambda g, inv, b=b: jamp_kernels.unscale_and_check(g, inv, backend=b)) for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_bit_for_bit(tree, jitted, backend):
    out, found = jitted[backend](tree, INV)
    assert found.shape == () and found.dtype == jnp.bool_ and not found
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for key, leaf in tree.items():
        assert_same_bits(out[key], reference(leaf, INV))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_nonfinite_kind_at_both_ends_of_every_leaf(tree, jitted, backend):
    for key, leaf in tree.items():
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.size == 0:
            continue
        for position in (0, leaf.size - 1):
            for bad in (np.inf, -np.inf, np.nan):
                flat = np.array(leaf).reshape(-1)
                flat[position] = bad
                poisoned = dict(tree, **{key: jnp.asarray(flat.reshape(leaf.shape))})
                out, found = jitted[backend](poisoned, INV)
                assert found, (key, position, bad)
                assert_same_bits(out[key], reference(poisoned[key], INV))  # still unscaled, as torch does


SUBNORMALS = {
    "f32": jnp.array([1e-40, -3e-39, 1e-45, 2.0], jnp.float32),
    "bf16": jnp.array([1e-39, -2e-40, 1.0], jnp.bfloat16),
    "f16": jnp.array([1e-7, -3e-8, 6e-8, 1.0], jnp.float16),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_inv_scale_one_passes_subnormals_through(backend):
    """torch's kernel returns the input when inv_scale == 1; XLA:CPU flushes subnormal products to zero,
    and on CPUs with AVX512-BF16 also every bfloat16 subnormal it narrows from float32 (it widens bfloat16
    selects, loads and stores to float32). Several leaves, so the interpret kernel branches between them
    (the layout that flushed on such a CPU before the kernel moved bits)."""
    out, found = jamp_kernels.unscale_and_check(SUBNORMALS, 1.0, backend=backend)
    assert not found
    for key in SUBNORMALS:
        assert_same_bits(out[key], SUBNORMALS[key])


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_values_returned_unchanged_are_moved_as_bits(backend):
    """The host-independent half of the test above: the kernel's leaves enter and leave the Pallas call as
    unsigned integers of their width, and the inv_scale == 1 select of a 16-bit leaf picks bits, so no
    convert can touch an input that comes back unchanged, whichever instruction a CPU converts with (a
    float32 select is no convert: it picks floats)."""
    closed = jax.make_jaxpr(lambda g, inv: jamp_kernels.unscale_and_check(g, inv, backend=backend))(SUBNORMALS, 1.0)
    selects = [e for e in eqns(closed) if e.primitive.name == "select_n" and e.outvars[0].aval.ndim]
    narrow = [e for e in selects if e.outvars[0].aval.dtype.itemsize == 2]
    assert len(narrow) >= 2 and all(e.outvars[0].aval.dtype.kind == "u" for e in narrow), selects
    assert all(e.outvars[0].aval.dtype.kind in "uf" for e in selects), selects
    calls = [e for e in eqns(closed) if e.primitive.name == "pallas_call"]
    assert len(calls) == (backend == "interpret")
    for call in calls:
        leaves = call.invars[1:]  # after the inv_scale pair
        assert [v.aval.dtype for v in leaves] == [
            np.dtype(f"uint{8 * g.dtype.itemsize}") for g in jax.tree.leaves(SUBNORMALS)
        ]
        assert [v.aval.dtype for v in call.outvars[:-1]] == [v.aval.dtype for v in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_looks_at_inputs_not_outputs(backend):
    """A scale below one can overflow a float16 output; only inf/NaN inputs count (torch)."""
    g = {"h": jnp.array([65504.0, 1.0], jnp.float16)}
    out, found = jamp_kernels.unscale_and_check(g, 4.0, backend=backend)
    assert not found
    assert_same_bits(out["h"], np.array([np.inf, 4.0], np.float16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_call_and_float16_rounding(backend):
    """``65504 * (1/3)`` rounds once to float16 21840 (torch_amp_behavior.md §1.4)."""
    out, found = jamp_kernels.unscale_and_check([jnp.array([65504.0], jnp.float16)], INV, backend=backend)
    assert out[0].dtype == jnp.float16 and float(out[0][0]) == 21840.0 and not found


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_floating_leaves_nothing_runs(backend):
    g = {"step": jnp.arange(3), "empty": jnp.zeros((0,), jnp.float32), "int_grad": np.zeros((2,), jax.dtypes.float0)}
    out, found = jamp_kernels.unscale_and_check(g, 0.5, backend=backend)
    assert out is g and not found


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_gives_one_flag_per_example(backend):
    rng = np.random.default_rng(1)
    batch = {
        "w": jnp.asarray(rng.standard_normal((3, 1000)), jnp.float32),
        "h": jnp.asarray(rng.standard_normal((3, 4097)), jnp.float16),
    }
    batch["h"] = batch["h"].at[1, 4096].set(jnp.inf)
    out, found = jax.jit(jax.vmap(lambda g: jamp_kernels.unscale_and_check(g, INV, backend=backend)))(batch)
    np.testing.assert_array_equal(found, [False, True, False])
    for key, leaf in batch.items():
        assert_same_bits(out[key], reference(leaf, INV))


def test_groups_of_leaves_become_separate_launches(monkeypatch):
    monkeypatch.setattr(pallas_triton, "MAX_LEAVES_PER_CALL", 2)
    leaves = [jnp.full((n,), n, jnp.float32) for n in (3, 5, 9, 17, 33)]
    fn = jax.jit(lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend="interpret"))
    assert str(fn.trace(leaves).jaxpr).count("pallas_call") == 3
    out, found = fn(leaves)
    assert not found
    for got, leaf in zip(out, leaves):
        assert_same_bits(got, reference(leaf, 0.5))
    leaves[-1] = leaves[-1].at[32].set(jnp.nan)
    assert fn(leaves)[1]


def test_donated_gradients_give_the_same_result():
    """The aliasing itself is checked on the Triton lowering (test_kernels_lowering.py)."""
    fn = jax.jit(lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend="interpret", donate=True), donate_argnums=0)
    grads = [jnp.arange(4097, dtype=jnp.float32), jnp.ones((3, 3), jnp.bfloat16)]
    want = [reference(g, 0.5) for g in grads]
    out, found = fn(grads)
    assert not found
    for got, w in zip(out, want):
        assert_same_bits(got, w)


def test_auto_runs_xla_off_cuda(tree):
    """On CPU, "auto" lowers only the XLA branch: no interpreted grid loop, no Triton call."""
    hlo = jax.jit(lambda g: jamp_kernels.unscale_and_check(g, INV)).lower(tree).compile().as_text()
    assert "while" not in hlo and "triton" not in hlo


def test_public_helpers_agree_with_the_fused_call(tree):
    out, found = jamp_kernels.unscale_and_check(tree, INV, backend="xla")
    for key, leaf in jax.jit(jamp_kernels.unscale)(tree, INV).items():
        assert_same_bits(leaf, out[key])
    assert jax.jit(jamp_kernels.has_nonfinite)(tree) == found


def test_has_nonfinite_sees_a_nan_that_xla_cpu_max_drops():
    """XLA:CPU's vectorised float32 max reduction returns 1.0 for this array, so ``~isfinite(max|g|)`` misses it."""
    g = jnp.ones(4097, jnp.float32).at[0].set(jnp.nan)
    assert jax.jit(jamp_kernels.has_nonfinite)([g])


def _view_edges(n: int) -> set[int]:
    """Positions where the CPU check's views of an ``n``-element leaf start, end and overlap (computed here,
    not read from jamp_kernels.xla): ``ceil(n / 16)``-long views from SPLIT_AT on, else the largest power
    of two <= n, the last view ending at the leaf's end."""
    length = -(-n // xla.VIEWS_PER_LOOP) if n >= xla.SPLIT_AT else 1 << (n.bit_length() - 1)
    edges = {0, n - 1, n - length - 1, n - length}
    for j in range(1, -(-n // length) + 1):
        edges |= {j * length - 1, j * length}
    return {e for e in edges if 0 <= e < n}


def test_cpu_check_finds_every_nonfinite_kind_at_every_view_edge():
    """The CPU form (views summed in loops, jamp_kernels.xla) is exact wherever the inf/NaN sits: at the start,
    end and overlap of every view, in leaves that share loops, in every half/single dtype."""
    sizes = (1, 3, 5, 1000, 1000, 1000, xla.SPLIT_AT - 1, xla.SPLIT_AT, 16 * 4097 + 5)
    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        tree = [jnp.asarray(rng.standard_normal(n) * 1024, dtype) for n in sizes]

        @jax.jit
        def check(tree, leaf, position, value):
            return jamp_kernels.has_nonfinite(
                [
                    jnp.where((leaf == i) & (jnp.arange(g.size) == position), value.astype(g.dtype), g)
                    for i, g in enumerate(tree)
                ],
                backend="xla",
            )

        assert not check(tree, -1, 0, jnp.float32(0))
        for i, n in enumerate(sizes):
            positions = _view_edges(n) | set(rng.integers(0, n, 3).tolist())
            for j, position in enumerate(sorted(positions)):
                value = (np.nan, np.inf, -np.inf)[j % 3]
                assert check(tree, i, position, jnp.float32(value)), (dtype, n, position, value)


def test_cpu_check_reads_the_gradients_in_elementwise_loops():
    """HLO facts behind the CPU check's speed: no floating-point reduction (XLA:CPU does not split those across
    threads), and 1000 equal leaves share loops (two views each, 16 views a loop)."""
    tree = [jnp.ones(1000)] * 1000 + [jnp.ones((300, 1000))]
    hlo = jax.jit(lambda g: jamp_kernels.has_nonfinite(g, backend="xla")).lower(tree).compile(as_users()).as_text()
    assert not re.search(r"= (f16|bf16|f32|f64)\[[0-9,]*\]\S* (reduce|reduce-window)\(", hlo)  # fused bodies too
    assert len(re.findall(r"= pred\[512\]\S* fusion\(", hlo)) == 2000 // xla.VIEWS_PER_LOOP


def test_check_form_per_platform():
    """CHECK_OF_PLATFORM: views sliced into loops when lowered for a CPU, a reduction per leaf for CUDA."""
    tree = {"w": jnp.ones((300, 1000)), "b": jnp.ones(1000)}
    fn = functools.partial(jamp_kernels.has_nonfinite, backend="xla")
    cpu = jax.jit(fn).lower(tree).as_text()
    cuda = lower_for_cuda(fn, tree).as_text()
    assert "stablehlo.slice" in cpu and "stablehlo.reduce" in cpu
    assert "stablehlo.slice" not in cuda and cuda.count("stablehlo.reduce(") + cuda.count("stablehlo.reduce ") >= 2


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'xla', 'pallas', 'interpret'\)"):
        jamp_kernels.unscale_and_check([jnp.ones(3)], 0.5, backend="cuda")
    with pytest.raises(TypeError, match=r"grads\['b'\] is a float"):
        jamp_kernels.unscale_and_check({"a": jnp.ones(2), "b": 1.0}, 0.5)
    with pytest.raises(TypeError, match="complex"):
        jamp_kernels.unscale_and_check([jnp.ones(2, jnp.complex64)], 0.5)
    with pytest.raises(ValueError, match="inv_scale"):
        jamp_kernels.unscale_and_check([jnp.ones(2)], jnp.ones(3))


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 2.0**126, 2.0**127, 3.0e38])
def test_inverse_pair_unscales_scales_whose_reciprocal_is_subnormal(backend, scale):
    """torch's float32 1/scale is subnormal above 2**126 and XLA would flush it (zeroing every gradient)."""
    grads = [jnp.array([1.0, -0.5, 2.0**-3], jnp.float32) * jnp.float32(scale)]
    out, found = jamp_kernels.unscale_and_check(grads, jamp_kernels.inverse(scale), backend=backend)
    expected = np.asarray(grads[0], np.float64) / np.float64(np.float32(scale))
    np.testing.assert_allclose(np.asarray(out[0], np.float64), expected, rtol=2**-23)
    assert not bool(found)
    if scale <= 2.0**126:  # normal range: bit-identical to the plain float32 reciprocal, as torch
        plain, _ = jamp_kernels.unscale_and_check(grads, jnp.float32(1.0) / jnp.float32(scale), backend=backend)
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(plain[0]))


def test_inverse_of_every_subnormal_scale_is_exact():
    """XLA flushes a subnormal scale to zero before 1/scale; the pair must still hold 1/scale rounded to
    24 bits (torch's float32 reciprocal where that is finite), never inf."""
    scales = np.arange(1, 2**23, dtype=np.uint32).view(np.float32)  # every positive subnormal, m * 2**-149
    out = jax.jit(jamp_kernels.inverse)(scales)
    assert out.dtype == jnp.float32 and out.shape == (2, scales.size)
    pair = np.asarray(out, np.float64)
    # 1/scale * 2**-64 is a normal float32 here, so NumPy's float32 rounding is the 24-bit rounding
    want = (1.0 / scales.astype(np.float64) * 2.0**-64).astype(np.float32).astype(np.float64) * 2.0**64
    np.testing.assert_array_equal(pair[0] * pair[1], want)


def test_importing_the_kernels_does_not_import_jamp():
    code = "import sys, jamp_kernels; assert 'jamp' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=jamp_kernels.__path__[0] + "/..")
