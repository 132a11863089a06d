"""The coverage sweep's cases: public functions of jax.numpy (linalg, fft), jax.nn, jax.lax,
jax.scipy.special and optax losses, each with the input domain it needs.

A case is ``(name, fn, domain, arity)``. ``fn`` takes ``arity`` float arrays of shape (4, 8)
(the first comes out of a matmul, so it arrives in the compute dtype; the others are float32)
and returns an array or a tuple of arrays. Domains: ``real`` N(0, 0.8), ``pos`` U(0.5, 2),
``unit`` U(-0.9, 0.9), ``prob`` U(0.05, 0.95), ``gt1`` U(1.1, 3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import optax
from jax import lax

p = functools.partial
IDX = jnp.array([0, 2, 3, 1])
LABELS = jnp.array([1, 0, 7, 3])


def _unary(domain, names, module=jnp, **kw):
    return [
        (f"{module.__name__.split('.')[-1]}.{n}", p(getattr(module, n), **kw) if kw else getattr(module, n), domain, 1)
        for n in names.split()
    ]


def _binary(domain, names, module=jnp):
    return [(f"{module.__name__.split('.')[-1]}.{n}", getattr(module, n), domain, 2) for n in names.split()]


def _sq(x):
    """A well-conditioned square matrix from a (4, 8) input."""
    return x[:, :4] @ x[:, :4].T + 4 * jnp.eye(4)


def _pool(kind):
    def pool(x):
        init, op = {"max": (-jnp.inf, lax.max), "sum": (0.0, lax.add)}[kind]
        return lax.reduce_window(x, jnp.asarray(init, x.dtype), op, (2, 2), (1, 1), "VALID")

    return pool


def _scan_cumsum(x):
    return lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8, x.dtype), x)


def _while(x):
    return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 1.5, c[1] + 1), (x, 0))[0]


def _conv(x):
    return lax.conv_general_dilated(
        x[None, :, :, None], jnp.ones((2, 2, 1, 3)), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


CASES = [
    # ---- jax.numpy elementwise ------------------------------------------------------------------
    *_unary(
        "real",
        "abs absolute negative positive sign floor ceil round rint trunc square cbrt "
        "sin cos tan sinh cosh tanh arcsinh arctan deg2rad rad2deg degrees radians sinc "
        "exp exp2 expm1 signbit isfinite isnan isinf isposinf isneginf logical_not conj real "
        "imag angle nan_to_num fabs spacing i0 ones_like zeros_like empty_like copy "
        "iscomplex isreal",
    ),
    *_unary("pos", "sqrt log log2 log10 log1p reciprocal"),
    *_unary("unit", "arcsin arccos arctanh"),
    *_unary("gt1", "arccosh"),
    ("jnp.frexp", lambda x: jnp.frexp(x), "real", 1),
    ("jnp.modf", lambda x: jnp.modf(x), "real", 1),
    ("jnp.float_power2", lambda x: jnp.float_power(x, 2), "real", 1),
    ("jnp.power_scalar", lambda x: jnp.power(x, 3), "real", 1),
    ("jnp.power_frac", lambda x: x**1.7, "pos", 1),
    ("jnp.ldexp", lambda x: jnp.ldexp(x, 2), "real", 1),
    ("jnp.clip", lambda x: jnp.clip(x, -0.5, 0.5), "real", 1),
    ("jnp.heaviside", lambda x: jnp.heaviside(x, 0.5), "real", 1),
    ("jnp.where_scalar", lambda x: jnp.where(x > 0, x, 0.0), "real", 1),
    ("jnp.isclose_self", lambda x: jnp.isclose(x, x * 1.001), "real", 1),
    ("jnp.astype_int", lambda x: (x * 10).astype(jnp.int32), "real", 1),
    ("jnp.astype_bool", lambda x: x.astype(bool), "real", 1),
    ("jnp.nan_to_num_inf", lambda x: jnp.nan_to_num(x / (x - x)), "real", 1),
    *_binary(
        "real",
        "add subtract multiply maximum minimum fmax fmin arctan2 hypot copysign nextafter "
        "logaddexp logaddexp2 greater greater_equal less less_equal equal not_equal "
        "logical_and logical_or logical_xor heaviside isclose",
    ),
    *_binary("pos", "divide true_divide floor_divide remainder mod fmod power float_power"),
    ("jnp.divmod", jnp.divmod, "pos", 2),
    ("jnp.where", lambda x, y: jnp.where(x > y, x, y), "real", 2),
    ("jnp.select", lambda x, y: jnp.select([x > 0, y > 0], [x, y], 0.5), "real", 2),
    ("jnp.polyval", lambda x: jnp.polyval(jnp.array([0.5, -1.0, 2.0]), x), "real", 1),
    ("jnp.interp", lambda x: jnp.interp(x, jnp.linspace(-2, 2, 5), jnp.arange(5.0)), "real", 1),
    # ---- jax.numpy reductions and scans ---------------------------------------------------------
    *_unary(
        "real",
        "sum prod mean std var max min amax amin argmax argmin nansum nanmean nanstd nanvar "
        "nanmax nanmin nanprod ptp median nanmedian average count_nonzero all any cumsum "
        "cumprod nancumsum nancumprod trace diagonal diff ediff1d sort argsort",
    ),
    ("jnp.sum_axis", p(jnp.sum, axis=1), "real", 1),
    ("jnp.mean_axis_keepdims", p(jnp.mean, axis=0, keepdims=True), "real", 1),
    ("jnp.var_ddof", p(jnp.var, axis=1, ddof=1), "real", 1),
    ("jnp.percentile", lambda x: jnp.percentile(x, 30.0), "real", 1),
    ("jnp.quantile", lambda x: jnp.quantile(x, 0.7, axis=1), "real", 1),
    ("jnp.nanpercentile", lambda x: jnp.nanpercentile(x, 50.0), "real", 1),
    ("jnp.cumulative_sum", lambda x: jnp.cumulative_sum(x, axis=1), "real", 1),
    ("jnp.cumulative_prod", lambda x: jnp.cumulative_prod(x, axis=0), "real", 1),
    ("jnp.sum_dtype_f32", lambda x: jnp.sum(x, dtype=jnp.float32), "real", 1),
    ("jnp.mean_where", lambda x: jnp.mean(x, where=x > 0), "real", 1),
    ("jnp.gradient", lambda x: jnp.gradient(x, axis=1), "real", 1),
    ("jnp.trapezoid", lambda x: jnp.trapezoid(x, axis=1), "real", 1),
    ("jnp.cov", jnp.cov, "real", 1),
    ("jnp.corrcoef", jnp.corrcoef, "real", 1),
    ("jnp.average_weights", lambda x, w: jnp.average(x, weights=jnp.abs(w) + 0.1), "real", 2),
    ("jnp.argsort_desc", lambda x: jnp.argsort(-x, axis=1), "real", 1),
    ("jnp.partition", lambda x: jnp.partition(x, 3, axis=1), "real", 1),
    ("jnp.argpartition", lambda x: jnp.argpartition(x, 3, axis=1), "real", 1),
    ("jnp.searchsorted", lambda x: jnp.searchsorted(jnp.linspace(-2, 2, 9), x), "real", 1),
    ("jnp.digitize", lambda x: jnp.digitize(x, jnp.linspace(-2, 2, 9)), "real", 1),
    ("jnp.histogram", lambda x: jnp.histogram(x, bins=5, range=(-2, 2))[0], "real", 1),
    ("jnp.bincount", lambda x: jnp.bincount(jnp.clip((x * 3).astype(int), 0, 5).ravel(), length=6), "pos", 1),
    ("jnp.unique_size", lambda x: jnp.unique(jnp.round(x), size=8, fill_value=0.0), "real", 1),
    ("jnp.lexsort", lambda x: jnp.lexsort((x[0], x[1])), "real", 1),
    ("jnp.allclose", lambda x: jnp.allclose(x, x), "real", 1),
    ("jnp.array_equal", lambda x: jnp.array_equal(x, x), "real", 1),
    # ---- jax.numpy shape and indexing -----------------------------------------------------------
    *_unary("real", "flip fliplr flipud rot90 transpose ravel squeeze atleast_1d atleast_2d atleast_3d tril triu"),
    ("jnp.roll", lambda x: jnp.roll(x, 2, axis=1), "real", 1),
    ("jnp.swapaxes", lambda x: jnp.swapaxes(x, 0, 1), "real", 1),
    ("jnp.moveaxis", lambda x: jnp.moveaxis(x, 0, 1), "real", 1),
    ("jnp.reshape", lambda x: jnp.reshape(x, (8, 4)), "real", 1),
    ("jnp.expand_dims", lambda x: jnp.expand_dims(x, 1), "real", 1),
    ("jnp.tile", lambda x: jnp.tile(x, (2, 1)), "real", 1),
    ("jnp.repeat", lambda x: jnp.repeat(x, 2, axis=0), "real", 1),
    ("jnp.broadcast_to", lambda x: jnp.broadcast_to(x, (3, 4, 8)), "real", 1),
    ("jnp.split", lambda x: jnp.split(x, 2, axis=1), "real", 1),
    ("jnp.array_split", lambda x: jnp.array_split(x, 3, axis=1), "real", 1),
    ("jnp.pad_constant", lambda x: jnp.pad(x, 2, constant_values=0.5), "real", 1),
    ("jnp.pad_reflect", lambda x: jnp.pad(x, 2, mode="reflect"), "real", 1),
    ("jnp.pad_edge", lambda x: jnp.pad(x, 1, mode="edge"), "real", 1),
    ("jnp.pad_wrap", lambda x: jnp.pad(x, 1, mode="wrap"), "real", 1),
    ("jnp.take", lambda x: jnp.take(x, IDX, axis=1), "real", 1),
    ("jnp.take_along_axis", lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1), "real", 1),
    ("jnp.getitem_fancy", lambda x: x[IDX, IDX], "real", 1),
    ("jnp.getitem_slice", lambda x: x[1:3, ::2], "real", 1),
    ("jnp.getitem_bool_where", lambda x: jnp.where(x > 0, size=32, fill_value=0)[1], "real", 1),
    ("jnp.at_set", lambda x, y: x.at[IDX, 0].set(y[0, :4]), "real", 2),
    ("jnp.at_add", lambda x, y: x.at[IDX].add(y), "real", 2),
    ("jnp.at_mul", lambda x, y: x.at[0].multiply(y[0]), "real", 2),
    ("jnp.at_max", lambda x, y: x.at[:, 1].max(y[:, 1]), "real", 2),
    ("jnp.at_min", lambda x, y: x.at[2].min(y[2]), "real", 2),
    ("jnp.concatenate", lambda x, y: jnp.concatenate([x, y], axis=1), "real", 2),
    ("jnp.stack", lambda x, y: jnp.stack([x, y]), "real", 2),
    ("jnp.hstack", lambda x, y: jnp.hstack([x, y]), "real", 2),
    ("jnp.vstack", lambda x, y: jnp.vstack([x, y]), "real", 2),
    ("jnp.dstack", lambda x, y: jnp.dstack([x, y]), "real", 2),
    ("jnp.column_stack", lambda x, y: jnp.column_stack([x, y]), "real", 2),
    ("jnp.append", lambda x, y: jnp.append(x, y, axis=0), "real", 2),
    ("jnp.insert", lambda x: jnp.insert(x, 2, 0.5, axis=1), "real", 1),
    ("jnp.delete", lambda x: jnp.delete(x, 2, axis=1, assume_unique_indices=True), "real", 1),
    ("jnp.meshgrid", lambda x: jnp.meshgrid(x[0], x[1]), "real", 1),
    ("jnp.diag", lambda x: jnp.diag(x[0]), "real", 1),
    ("jnp.diagflat", lambda x: jnp.diagflat(x[0, :3]), "real", 1),
    ("jnp.fill_diagonal", lambda x: jnp.fill_diagonal(x, 0.0, inplace=False), "real", 1),
    ("jnp.triu_k", lambda x: jnp.triu(x, 1), "real", 1),
    ("jnp.compress", lambda x: jnp.compress(x[:, 0] > 0, x, axis=0, size=4), "real", 1),
    ("jnp.choose", lambda x, y: jnp.choose(jnp.array([0, 1, 0, 1])[:, None], [x, y], mode="clip"), "real", 2),
    ("jnp.extract_size", lambda x: jnp.extract(x > 0, x, size=8), "real", 1),
    ("jnp.nonzero_size", lambda x: jnp.nonzero(x > 0, size=8)[1], "real", 1),
    ("jnp.argwhere_size", lambda x: jnp.argwhere(x > 0, size=8), "real", 1),
    ("jnp.flatnonzero_size", lambda x: jnp.flatnonzero(x > 0, size=8), "real", 1),
    ("jnp.piecewise", lambda x: jnp.piecewise(x, [x < 0, x >= 0], [lambda v: -v, lambda v: v * 2]), "real", 1),
    ("jnp.apply_along_axis", lambda x: jnp.apply_along_axis(jnp.sum, 1, x), "real", 1),
    ("jnp.vectorize", lambda x: jnp.vectorize(lambda r: jnp.dot(r, r), signature="(n)->()")(x), "real", 1),
    # ---- jax.numpy products -----------------------------------------------------------------------
    ("jnp.matmul", lambda x, y: jnp.matmul(x, y.T), "real", 2),
    ("jnp.dot", lambda x, y: jnp.dot(x, y.T), "real", 2),
    ("jnp.vdot", jnp.vdot, "real", 2),
    ("jnp.inner", jnp.inner, "real", 2),
    ("jnp.outer", lambda x, y: jnp.outer(x[0], y[0]), "real", 2),
    ("jnp.tensordot", lambda x, y: jnp.tensordot(x, y, axes=([1], [1])), "real", 2),
    ("jnp.einsum", lambda x, y: jnp.einsum("ij,kj->ik", x, y), "real", 2),
    ("jnp.einsum_trace", lambda x: jnp.einsum("ii->", x[:, :4]), "real", 1),
    ("jnp.kron", lambda x, y: jnp.kron(x[:2, :2], y[:2, :2]), "real", 2),
    ("jnp.cross", lambda x, y: jnp.cross(x[:, :3], y[:, :3]), "real", 2),
    ("jnp.convolve", lambda x, y: jnp.convolve(x[0], y[0, :3]), "real", 2),
    ("jnp.correlate", lambda x, y: jnp.correlate(x[0], y[0, :3], mode="same"), "real", 2),
    ("jnp.vecdot", jnp.vecdot, "real", 2),
    ("jnp.matvec", lambda x, y: jnp.matvec(x, y[0]), "real", 2),
    # ---- linear algebra and FFT -----------------------------------------------------------------
    ("linalg.inv", lambda x: jnp.linalg.inv(_sq(x)), "real", 1),
    ("linalg.solve", lambda x: jnp.linalg.solve(_sq(x), x[:, :2]), "real", 1),
    ("linalg.det", lambda x: jnp.linalg.det(_sq(x)), "real", 1),
    ("linalg.slogdet", lambda x: jnp.linalg.slogdet(_sq(x))[1], "real", 1),
    ("linalg.cholesky", lambda x: jnp.linalg.cholesky(_sq(x)), "real", 1),
    ("linalg.eigh", lambda x: jnp.linalg.eigh(_sq(x))[0], "real", 1),
    ("linalg.eigvalsh", lambda x: jnp.linalg.eigvalsh(_sq(x)), "real", 1),
    ("linalg.svd_values", lambda x: jnp.linalg.svd(x, compute_uv=False), "real", 1),
    ("linalg.svdvals", lambda x: jnp.linalg.svdvals(x), "real", 1),
    ("linalg.qr_r", lambda x: jnp.abs(jnp.linalg.qr(x)[1]), "real", 1),
    ("linalg.pinv", lambda x: jnp.linalg.pinv(x), "real", 1),
    ("linalg.matrix_power", lambda x: jnp.linalg.matrix_power(_sq(x) / 8, 3), "real", 1),
    ("linalg.matrix_rank", lambda x: jnp.linalg.matrix_rank(x), "real", 1),
    ("linalg.norm", jnp.linalg.norm, "real", 1),
    ("linalg.norm_fro_axis", lambda x: jnp.linalg.norm(x, axis=1), "real", 1),
    ("linalg.norm_inf", lambda x: jnp.linalg.norm(x, ord=jnp.inf), "real", 1),
    ("linalg.norm_nuc", lambda x: jnp.linalg.norm(x, ord="nuc"), "real", 1),
    ("linalg.vector_norm", lambda x: jnp.linalg.vector_norm(x, axis=1), "real", 1),
    ("linalg.matrix_norm", lambda x: jnp.linalg.matrix_norm(x), "real", 1),
    ("linalg.lstsq", lambda x: jnp.linalg.lstsq(x.T, x[0])[0], "real", 1),
    ("linalg.cond", lambda x: jnp.linalg.cond(_sq(x)), "real", 1),
    ("linalg.multi_dot", lambda x, y: jnp.linalg.multi_dot([x, y.T, x]), "real", 2),
    ("linalg.tensorsolve", lambda x: jnp.linalg.tensorsolve(_sq(x), x[:, 0]), "real", 1),
    ("linalg.trace", lambda x: jnp.linalg.trace(_sq(x)), "real", 1),
    ("linalg.outer", lambda x, y: jnp.linalg.outer(x[0], y[0]), "real", 2),
    (
        "scipy.linalg.solve_triangular",
        lambda x: jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(_sq(x)), x[:, :2], lower=True),
        "real",
        1,
    ),
    (
        "scipy.linalg.cho_solve",
        lambda x: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(_sq(x)), x[:, :2]),
        "real",
        1,
    ),
    (
        "scipy.linalg.lu_solve",
        lambda x: jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(_sq(x)), x[:, :2]),
        "real",
        1,
    ),
    ("scipy.linalg.expm", lambda x: jax.scipy.linalg.expm(_sq(x) / 8), "real", 1),
    ("scipy.linalg.lu", lambda x: jax.scipy.linalg.lu(_sq(x))[2], "real", 1),
    ("scipy.linalg.det", lambda x: jax.scipy.linalg.det(_sq(x)), "real", 1),
    ("fft.fft", lambda x: jnp.abs(jnp.fft.fft(x)), "real", 1),
    ("fft.ifft", lambda x: jnp.fft.ifft(x).real, "real", 1),
    ("fft.rfft", lambda x: jnp.abs(jnp.fft.rfft(x)), "real", 1),
    ("fft.irfft", lambda x: jnp.fft.irfft(x), "real", 1),
    ("fft.fft2", lambda x: jnp.fft.fft2(x).real, "real", 1),
    ("fft.rfft2", lambda x: jnp.fft.rfft2(x).imag, "real", 1),
    ("fft.irfft2", lambda x: jnp.fft.irfft2(x), "real", 1),
    ("fft.fftn", lambda x: jnp.abs(jnp.fft.fftn(x)), "real", 1),
    ("fft.hfft", lambda x: jnp.fft.hfft(x), "real", 1),
    ("fft.ihfft", lambda x: jnp.fft.ihfft(x).real, "real", 1),
    ("fft.fftshift", jnp.fft.fftshift, "real", 1),
    ("fft.ifftshift", jnp.fft.ifftshift, "real", 1),
    # ---- jax.nn ---------------------------------------------------------------------------------
    *_unary(
        "real",
        "relu relu6 sigmoid softplus soft_sign silu swish log_sigmoid leaky_relu hard_sigmoid "
        "hard_silu hard_swish hard_tanh elu celu selu gelu glu logsumexp log_softmax softmax "
        "standardize tanh sparse_plus sparse_sigmoid squareplus mish identity",
        module=jax.nn,
    ),
    ("nn.gelu_exact", p(jax.nn.gelu, approximate=False), "real", 1),
    ("nn.softmax_axis0", p(jax.nn.softmax, axis=0), "real", 1),
    ("nn.log_softmax_where", lambda x: jax.nn.log_softmax(x, where=x > -1.0), "real", 1),
    ("nn.logsumexp_b", lambda x: jax.nn.logsumexp(x, axis=1, b=0.5), "real", 1),
    ("nn.one_hot", lambda x: jax.nn.one_hot(jnp.argmax(x, axis=1), 8), "real", 1),
    (
        "nn.dot_product_attention",
        lambda x, y: jax.nn.dot_product_attention(x.reshape(1, 4, 2, 4), y.reshape(1, 4, 2, 4), y.reshape(1, 4, 2, 4)),
        "real",
        2,
    ),
    (
        "nn.dot_product_attention_causal",
        lambda x: jax.nn.dot_product_attention(
            x.reshape(1, 4, 2, 4), x.reshape(1, 4, 2, 4), x.reshape(1, 4, 2, 4), is_causal=True
        ),
        "real",
        1,
    ),
    ("nn.normalize", lambda x: jax.nn.standardize(x, axis=0), "real", 1),
    # ---- jax.scipy.special ----------------------------------------------------------------------
    *_unary("real", "erf erfc expit ndtr log_ndtr i0 i0e i1 i1e logsumexp softmax log_softmax entr", module=jss),
    *_unary("pos", "gammaln digamma gamma expi exp1 spence", module=jss),
    *_unary("unit", "erfinv", module=jss),
    *_unary("prob", "logit ndtri", module=jss),
    *_binary("pos", "xlogy xlog1py gammainc gammaincc beta betaln rel_entr kl_div", module=jss),
    ("special.polygamma", lambda x: jss.polygamma(1, x), "pos", 1),
    ("special.zeta", lambda x: jss.zeta(x + 1.0, 1.0), "pos", 1),
    ("special.betainc", lambda x: jss.betainc(2.0, 3.0, x), "prob", 1),
    ("special.multigammaln", lambda x: jss.multigammaln(x + 1.0, 2), "pos", 1),
    ("special.expn", lambda x: jss.expn(2, x), "pos", 1),
    ("special.poch", lambda x: jss.poch(x, 2.0), "pos", 1),
    ("special.logsumexp_return_sign", lambda x: jss.logsumexp(x, axis=1, return_sign=True), "real", 1),
    # ---- jax.lax --------------------------------------------------------------------------------
    *_unary(
        "real",
        "abs neg sign floor ceil round is_finite exp exp2 expm1 tanh logistic sin cos tan atan "
        "asinh square cbrt erf erfc lgamma digamma bessel_i0e bessel_i1e stop_gradient",
        module=lax,
    ),
    *_unary("pos", "sqrt rsqrt log log1p", module=lax),
    *_unary("unit", "asin acos atanh erf_inv", module=lax),
    *_binary("real", "add sub mul max min atan2 nextafter eq ne lt le gt ge", module=lax),
    *_binary("pos", "div rem pow igamma igammac", module=lax),
    ("lax.integer_pow", lambda x: lax.integer_pow(x, 3), "real", 1),
    ("lax.clamp", lambda x: lax.clamp(-0.5, x, 0.5), "real", 1),
    ("lax.select_n", lambda x, y: lax.select_n(x > 0, x, y), "real", 2),
    ("lax.reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), "real", 1),
    ("lax.convert_element_type", lambda x: lax.convert_element_type(x, jnp.bfloat16), "real", 1),
    ("lax.bitcast_convert_type", lambda x: lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32), "real", 1),
    ("lax.dot_general", lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ()))), "real", 2),
    ("lax.batch_matmul", lambda x, y: lax.batch_matmul(x[None], y[None].transpose(0, 2, 1)), "real", 2),
    ("lax.conv", _conv, "real", 1),
    (
        "lax.conv_transpose",
        lambda x: lax.conv_transpose(
            x[None, :, :, None], jnp.ones((2, 2, 1, 2)), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        "real",
        1,
    ),
    ("lax.reduce_window_max", _pool("max"), "real", 1),
    ("lax.reduce_window_sum", _pool("sum"), "real", 1),
    ("lax.reduce_window_generic", lambda x: lax.reduce_window(x, 1.0, lax.mul, (2, 2), (1, 1), "VALID"), "pos", 1),
    ("lax.reduce_sum", lambda x: lax.reduce_sum(x, (0,)), "real", 1),
    ("lax.reduce_max", lambda x: lax.reduce_max(x, (1,)), "real", 1),
    ("lax.reduce_generic", lambda x: lax.reduce(x, 0.0, lax.add, (1,)), "real", 1),
    ("lax.argmax", lambda x: lax.argmax(x, 1, jnp.int32), "real", 1),
    ("lax.cumsum", lambda x: lax.cumsum(x, 1), "real", 1),
    ("lax.cumprod", lambda x: lax.cumprod(x, 0), "real", 1),
    ("lax.cummax", lambda x: lax.cummax(x, 1), "real", 1),
    ("lax.cummin", lambda x: lax.cummin(x, 1), "real", 1),
    ("lax.cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), "real", 1),
    ("lax.sort", lambda x: lax.sort(x, dimension=1), "real", 1),
    ("lax.sort_key_val", lambda x, y: lax.sort_key_val(x, y, dimension=1), "real", 2),
    ("lax.top_k", lambda x: lax.top_k(x, 3), "real", 1),
    ("lax.approx_max_k", lambda x: lax.approx_max_k(x, 3), "real", 1),
    ("lax.dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)), "real", 1),
    ("lax.dynamic_update_slice", lambda x, y: lax.dynamic_update_slice(x, y[:2, :3], (1, 2)), "real", 2),
    ("lax.dynamic_index_in_dim", lambda x: lax.dynamic_index_in_dim(x, 2, 0), "real", 1),
    ("lax.gather_take", lambda x: x[jnp.argmax(x, axis=0), jnp.arange(8)], "real", 1),
    ("lax.scatter_add", lambda x, y: x.at[IDX].add(y * 2), "real", 2),
    ("lax.pad", lambda x: lax.pad(x, 0.0, ((1, 1, 1), (0, 2, 0))), "real", 1),
    ("lax.rev", lambda x: lax.rev(x, (0, 1)), "real", 1),
    ("lax.transpose", lambda x: lax.transpose(x, (1, 0)), "real", 1),
    ("lax.broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (2, 4, 8), (1, 2)), "real", 1),
    ("lax.concatenate", lambda x, y: lax.concatenate([x, y], 0), "real", 2),
    ("lax.fori_loop", lambda x: lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sin(c), x), "real", 1),
    ("lax.fori_loop_dynamic", lambda x: lax.fori_loop(0, jnp.int32(3), lambda i, c: c * 0.9, x), "real", 1),
    ("lax.while_loop", _while, "real", 1),
    ("lax.scan", _scan_cumsum, "real", 1),
    ("lax.scan_reverse", lambda x: lax.scan(lambda c, r: (c * 0.5 + r, c), jnp.zeros(8), x, reverse=True), "real", 1),
    ("lax.map", lambda x: lax.map(jnp.sum, x), "real", 1),
    ("lax.cond", lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), "real", 1),
    ("lax.switch", lambda x: lax.switch(1, [jnp.sin, jnp.cos, jnp.tanh], x), "real", 1),
    ("lax.select_cond_mixed", lambda x, y: lax.cond(True, lambda a, b: a * b, lambda a, b: a + b, x, y), "real", 2),
    ("lax.associative_scan", lambda x: lax.associative_scan(jnp.add, x, axis=1), "real", 1),
    (
        "lax.custom_root",
        lambda x: lax.custom_root(
            lambda z: z * z - jnp.abs(x) - 1.0,
            jnp.ones_like(x),
            lambda f, z0: lax.fori_loop(0, 20, lambda i, z: z - f(z) / (2 * z), z0),
            lambda g, y: y / 2.0,
        ),
        "real",
        1,
    ),
    (
        "lax.custom_linear_solve",
        lambda x: lax.custom_linear_solve(lambda v: 2.0 * v, x, lambda mv, b: b / 2.0),
        "real",
        1,
    ),
    ("lax.optimization_barrier", lambda x: lax.optimization_barrier(x) * 2, "real", 1),
    ("checkpoint", lambda x: jax.checkpoint(lambda v: jnp.sin(v) * v)(x), "real", 1),
    ("jit_nested", lambda x: jax.jit(lambda v: jnp.tanh(v) @ v.T)(x), "real", 1),
    ("vmap_inner", lambda x: jax.vmap(jnp.dot)(x, x), "real", 1),
    (
        "pure_callback",
        lambda x: jax.pure_callback(lambda v: v * 2, jax.ShapeDtypeStruct(x.shape, jnp.float32), x.astype(jnp.float32)),
        "real",
        1,
    ),
    # ---- image ----------------------------------------------------------------------------------
    ("image.resize_bilinear", lambda x: jax.image.resize(x, (8, 16), "bilinear"), "real", 1),
    ("image.resize_nearest", lambda x: jax.image.resize(x, (8, 16), "nearest"), "real", 1),
    (
        "image.scale_and_translate",
        lambda x: jax.image.scale_and_translate(
            x, (8, 8), (0, 1), jnp.array([2.0, 1.0]), jnp.array([0.0, 0.0]), "linear"
        ),
        "real",
        1,
    ),
    # ---- optax losses ---------------------------------------------------------------------------
    *_binary(
        "real",
        "l2_loss squared_error huber_loss log_cosh cosine_similarity cosine_distance "
        "softmax_cross_entropy sigmoid_binary_cross_entropy safe_softmax_cross_entropy "
        "convex_kl_divergence kl_divergence_with_log_targets",
        module=optax.losses,
    ),
    ("optax.l1_like_absolute_error", lambda x, y: optax.losses.huber_loss(x, y, delta=0.1), "real", 2),
    (
        "optax.softmax_cross_entropy_with_integer_labels",
        lambda x: optax.losses.softmax_cross_entropy_with_integer_labels(x, LABELS),
        "real",
        1,
    ),
    (
        "optax.kl_divergence",
        lambda x, y: optax.losses.kl_divergence(jax.nn.log_softmax(x), jax.nn.softmax(y)),
        "real",
        2,
    ),
    ("optax.sigmoid_focal_loss", lambda x, y: optax.losses.sigmoid_focal_loss(x, jax.nn.sigmoid(y)), "real", 2),
    ("optax.hinge_loss", lambda x, y: optax.losses.hinge_loss(x, jnp.sign(y)), "real", 2),
    ("optax.multiclass_hinge_loss", lambda x: optax.losses.multiclass_hinge_loss(x, LABELS), "real", 1),
    ("optax.multiclass_perceptron_loss", lambda x: optax.losses.multiclass_perceptron_loss(x, LABELS), "real", 1),
    ("optax.perceptron_loss", lambda x, y: optax.losses.perceptron_loss(x, jnp.sign(y)), "real", 2),
    (
        "optax.poly_loss_cross_entropy",
        lambda x, y: optax.losses.poly_loss_cross_entropy(x, jax.nn.softmax(y)),
        "real",
        2,
    ),
    ("optax.sparsemax_loss", lambda x: optax.losses.sparsemax_loss(x, (x > 0).astype(jnp.int32)), "real", 1),
    ("optax.smooth_labels", lambda x: optax.smooth_labels(jax.nn.softmax(x), 0.1), "real", 1),
    (
        "optax.ctc_loss",
        lambda x: optax.losses.ctc_loss(x[None], jnp.zeros((1, 4)), jnp.array([[1, 2]]), jnp.zeros((1, 2))),
        "real",
        1,
    ),
    ("optax.ranking_softmax_loss", lambda x, y: optax.losses.ranking_softmax_loss(x, jax.nn.relu(y)), "real", 2),
    ("optax.triplet_margin_loss", lambda x, y: optax.losses.triplet_margin_loss(x, y, -y), "real", 2),
    ("optax.ntxent", lambda x: optax.losses.ntxent(x, jnp.array([0, 0, 1, 1])), "real", 1),
    ("optax.squared_error_mean", lambda x, y: jnp.mean(optax.losses.squared_error(x, y)), "real", 2),
]
