"""The op reference as data: torch.amp's op lists mapped onto JAX primitives.

torch decides per ATen op; a jaxpr holds primitives. Each row maps one family of primitives
to a category for the GPU (CUDA) list and the CPU list of the seed's "Autocast Op Reference",
names the torch ops it stands for, and says why. The docs' op tables are generated from here.

Categories (what a rule does with the floating inputs of an equation):

- ``lower``: cast float16/bfloat16/float32 inputs to the compute dtype; matmul-like ops also get
  ``preferred_element_type`` = compute dtype so that their transposes (the backward matmuls)
  run in the compute dtype too. Under a policy with ``fp8`` on, an eligible ``dot_general`` runs
  as a float8 matmul with per-tensor scaling instead, emitting the compute dtype.
- ``float32``: cast float16/bfloat16 inputs up to float32.
- ``linalg``: like ``float32`` in every region mode but ``off``: decompositions have no
  low-precision kernels, so they must never see one. A jit whose body holds one runs in float32.
- ``promote``: multi-input ops that need equal dtypes: cast to the widest input (torch's
  promotion); scalar literals and rank-0 operands do not promote an array.
- ``passthrough``: run in whatever dtype arrives (torch's "ops not listed").
- ``default`` (any primitive not listed): inputs cast back to the dtypes the jaxpr recorded,
  so that an op jamp knows nothing about always sees the types it was traced with.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Category(enum.StrEnum):
    """What a policy says of a primitive: the op list it is on (a str, so policies can be written as strings)."""

    LOWER = "lower"  # torch's lower_precision_fp list: matmuls and convolutions in the compute dtype
    FLOAT32 = "float32"  # torch's fp32 list: numerically sensitive ops cast up
    LINALG = "linalg"  # decompositions and solves: float32 in every region (no low-precision kernels exist)
    PROMOTE = "promote"  # multi-input ops: cast to the widest input
    PASSTHROUGH = "passthrough"  # runs in whatever dtype arrives
    DEFAULT = "default"  # unknown to jamp: the input dtypes the jaxpr recorded


CATEGORIES = tuple(Category)
_C = Category

DEVICE_TYPES = ("gpu", "cpu", "tpu")
DEVICE_ALIASES = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}
# The seed has a CUDA list and a CPU list; TPU uses the CUDA list with bfloat16.
OPLIST_OF_DEVICE = {"gpu": "gpu", "cpu": "cpu", "tpu": "gpu"}
DEFAULT_DTYPE_OF_DEVICE = {"gpu": "float16", "cpu": "bfloat16", "tpu": "bfloat16"}


class OpRow(NamedTuple):
    primitives: tuple[str, ...]
    gpu: str
    cpu: str
    torch_ops: str
    why: str


def _row(prims: str, gpu: str, cpu: str, torch_ops: str, why: str) -> OpRow:
    return OpRow(tuple(prims.split()), gpu, cpu, torch_ops, why)


OP_TABLE: tuple[OpRow, ...] = (
    # ---- lower precision -------------------------------------------------------------------
    _row(
        "dot_general",
        _C.LOWER,
        _C.LOWER,
        "matmul, mm, bmm, mv, einsum, linear, addmm, addmv, addr, addbmm, baddbmm, chain_matmul, "
        "linalg_multi_dot, linalg_vecdot, the matmuls of scaled_dot_product_attention and RNN cells",
        "every JAX matmul/einsum/Dense is a dot_general; linear's bias add follows the matmul "
        "into the compute dtype (see the promote rule)",
    ),
    _row(
        "conv_general_dilated",
        _C.LOWER,
        _C.LOWER,
        "conv1d, conv2d, conv3d, conv_transpose1d/2d/3d, convolution, _convolution, conv_tbc",
        "every JAX/flax convolution, transposed ones included, is conv_general_dilated",
    ),
    _row("ragged_dot_general", _C.LOWER, _C.LOWER, "(no torch op: grouped matmul)", "a matmul like dot_general"),
    # ---- float32 on the CUDA list, input dtype on the CPU list -----------------------------
    _row(
        "exp exp2 log log1p expm1",
        _C.FLOAT32,
        _C.PASSTHROUGH,
        "exp, log, log10, log2, log1p, expm1",
        "CUDA list: fp32; CPU list: not autocast (runs in the input dtype)",
    ),
    _row(
        "pow",
        _C.FLOAT32,
        _C.PROMOTE,
        "pow.Tensor_Tensor, pow.Scalar, x ** 1.5",
        "CUDA: fp32; CPU: not autocast, but JAX's pow needs equal float dtypes",
    ),
    _row(
        "integer_pow",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "pow.Tensor_Scalar with an integer exponent, x ** 3",
        "deviation from the CUDA list (pow is fp32 there): JAX builds gelu's tanh form from x ** 3, and "
        "running it in float32 kept every MLP activation in float32 (4.7x the float32 memory saved for "
        "backward in benchmarks/autocast_overhead.py); gelu stays correct when x ** 3 overflows",
    ),
    _row(
        "rsqrt acos asin cosh sinh tan erf_inv",
        _C.FLOAT32,
        _C.PASSTHROUGH,
        "rsqrt, acos, asin, cosh, sinh, tan, erfinv",
        "CUDA fp32 list; not listed on CPU",
    ),
    _row(
        "reduce_sum",
        _C.FLOAT32,
        _C.PASSTHROUGH,
        "sum, mean's sum, the sums inside softmax, layer_norm, norms and losses",
        "CUDA: sum is fp32_set_opt_dtype (accumulate and return fp32); CPU: not autocast",
    ),
    _row(
        "cumsum cumprod cumlogsumexp",
        _C.FLOAT32,
        _C.PASSTHROUGH,
        "cumsum, cumprod, logcumsumexp",
        "CUDA fp32_set_opt_dtype; CPU: not autocast",
    ),
    _row("reduce_prod", _C.FLOAT32, _C.FLOAT32, "prod", "fp32 on both lists (CPU: plain fp32)"),
    _row(
        "lgamma digamma polygamma igamma igammac igamma_grad_a zeta bessel_i0e bessel_i1e regularized_incomplete_beta",
        _C.FLOAT32,
        _C.FLOAT32,
        "(torch.special: not on the lists)",
        "numerically touchy special functions; XLA has no native low-precision kernels for them",
    ),
    # ---- linear algebra and FFT: float32 always --------------------------------------------
    _row(
        "cholesky cholesky_update eig eigh hessenberg householder_product lu ormqr qr schur svd "
        "symmetric_product triangular_solve tridiagonal tridiagonal_solve",
        _C.LINALG,
        _C.LINALG,
        "cholesky, cholesky_solve, inverse, lu_solve, orgqr, ormqr, pinverse, linalg_* "
        "(CPU fp32 list: qr, svd, eigh, solve, inv, lstsq, ...)",
        "decompositions have no float16/bfloat16 kernels; the CPU list runs them in fp32 and "
        "jamp does so on every device",
    ),
    _row(
        "fft",
        _C.LINALG,
        _C.LINALG,
        "fft_fft, fft_ifft, fft_rfft, fft_irfft, fft_fftn, ... (CPU fp32 list)",
        "FFTs of low-precision data lose the small bins; fp32 on every device",
    ),
    # ---- promote: multi-input ops that need equal dtypes -----------------------------------
    _row(
        "add sub mul div rem max min atan2 nextafter add_any",
        _C.PROMOTE,
        _C.PROMOTE,
        "add, sub, mul, div, addcmul, addcdiv, atan2 (CUDA promote list) and built-in promotion",
        "JAX requires equal dtypes; torch promotes to the widest, so does jamp",
    ),
    _row("select_n clamp", _C.PROMOTE, _C.PROMOTE, "where, clamp", "cases/bounds must share a dtype"),
    _row(
        "concatenate",
        _C.PROMOTE,
        _C.PROMOTE,
        "cat, stack (CPU promote list; built-in promotion on CUDA)",
        "jnp.stack and jnp.concatenate are concatenate",
    ),
    _row(
        "eq ne lt le gt ge",
        _C.PROMOTE,
        _C.PROMOTE,
        "eq, ne, lt, le, gt, ge",
        "comparisons need equal input dtypes; the output is bool either way",
    ),
    _row(
        "dynamic_update_slice pad",
        _C.PROMOTE,
        _C.PROMOTE,
        "index_copy (CPU promote), pad",
        "the update/padding value must match the operand",
    ),
    # ---- passthrough: run in whatever dtype arrives ----------------------------------------
    _row(
        "square",
        _C.FLOAT32,
        _C.PASSTHROUGH,
        "pow.Tensor_Scalar(x, 2), the squares of layer_norm/var/norm",
        "CUDA: fp32 (pow); float16 squares overflow past |x| = 256, e.g. in a layer norm that no region "
        "rule covers (flax NNX adds no module scopes)",
    ),
    _row(
        "neg abs sign floor ceil round is_finite sqrt cbrt tanh logistic sin cos atan "
        "asinh acosh atanh erf erfc real imag conj",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "relu, gelu, sigmoid, tanh, sqrt, abs, ... (not listed: run in the input dtype)",
        "elementwise ops without a list entry run in the input dtype, as in torch",
    ),
    _row(
        "reshape broadcast_in_dim transpose squeeze slice dynamic_slice gather rev copy split tile stop_gradient",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "view, reshape, permute, index_select, narrow, detach, ...",
        "data movement is dtype-agnostic",
    ),
    _row(
        "reduce_max reduce_min argmax argmin cummax cummin sort top_k reduce_window_max "
        "reduce_window_min reduce_window_sum reduce_and reduce_or reduce_xor",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "max, amax, argmax, sort, topk, max_pool, avg_pool (not listed on CUDA)",
        "max/min/sort are exact in any dtype; pooling sums are not listed on the CUDA list",
    ),
    _row(
        "convert_element_type reduce_precision",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "Tensor.to, .float(), .half()",
        "a user's explicit cast is kept as written",
    ),
    _row(
        "not and or xor shift_left shift_right_arithmetic shift_right_logical population_count clz "
        "iota random_bits random_seed random_wrap random_unwrap random_fold_in random_split "
        "threefry2x32 axis_index",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "(integer, bool and PRNG ops)",
        "no floating inputs: nothing to cast",
    ),
    _row(
        "sharding_constraint optimization_barrier device_put name pvary psum pmax pmin "
        "all_gather all_gather_invariant all_to_all ppermute reduce_scatter psum_invariant reshard",
        _C.PASSTHROUGH,
        _C.PASSTHROUGH,
        "all_reduce, all_gather, ... (torch.distributed)",
        "collectives and annotations move values without arithmetic precision concerns",
    ),
)

# Composite functions that JAX stages as a named jit: the whole call gets a region mode,
# which maps torch's op-level entries (softplus, log_softmax, norm, upsample) onto them.
# jax.nn.dot_product_attention's XLA path computes its logits with the einsum below, asking for a float32
# result from low-precision q and k (so does torch's fused attention); a rounded logit error is
# exponentiated by the softmax. The einsum stages as a jit named by its subscripts.
_ATTENTION_LOGITS = (
    "BTNH,BSNH->BNTS",
    "float32_output",
    "scaled_dot_product_attention (lower precision, fused): jax.nn.dot_product_attention's "
    "logits einsum takes compute-dtype q, k and returns float32, as JAX does for "
    "low-precision inputs",
)

JIT_RULES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "gpu": (
        _ATTENTION_LOGITS,
        ("log_softmax", _C.FLOAT32, "log_softmax (fp32_set_opt_dtype)"),
        ("softplus", _C.FLOAT32, "softplus (fp32)"),
        ("norm", _C.FLOAT32, "norm, linalg_vector_norm, linalg_matrix_norm, frobenius_norm (fp32)"),
        ("standardize", _C.FLOAT32, "layer_norm (fp32): jax.nn.standardize is a layer norm"),
        ("_resize", _C.FLOAT32, "upsample_* (fp32): jax.image.resize"),
    ),
    "cpu": (
        _ATTENTION_LOGITS,
        (
            "log_softmax",
            _C.FLOAT32,
            "cross_entropy_loss, nll_loss (fp32 on the CPU list): "
            "optax.softmax_cross_entropy and hand-written losses use log_softmax. "
            "Deviation: torch's standalone CPU log_softmax runs in the input dtype",
        ),
    ),
}

# Name-scope / flax module path components: torch's norm layers are single fp32 ops on the
# CUDA list; flax builds them from primitives under a module scope named after the class, Equinox
# under a name scope "eqx.nn.<class>". torch's CPU list leaves the norms alone, but its CPU norm kernels
# compute in float32 and round once; flax's and Equinox's norms are a dozen primitives that would each
# round in bfloat16 (1.36-1.47x the hand-cast error in tests/casting/test_accuracy.py, where the libraries upcast
# low-precision inputs themselves), so they run in float32 on both lists.
_NORM_SCOPES = (
    (
        "LayerNorm*",
        _C.FLOAT32,
        "layer_norm, native_layer_norm (CUDA: fp32; CPU: a float32 kernel): flax LayerNorm modules",
    ),
    ("RMSNorm*", _C.FLOAT32, "rms_norm (CUDA: fp32; CPU: a float32 kernel): flax RMSNorm modules"),
    ("GroupNorm*", _C.FLOAT32, "group_norm (CUDA: fp32; CPU: a float32 kernel): flax GroupNorm modules"),
    ("eqx.nn.LayerNorm", _C.FLOAT32, "layer_norm (CUDA: fp32; CPU: a float32 kernel): Equinox LayerNorm"),
    (
        "eqx.nn.RMSNorm",
        _C.FLOAT32,
        "rms_norm (CUDA: fp32; CPU: a float32 kernel): Equinox RMSNorm (its x ** 2 overflows float16)",
    ),
    ("eqx.nn.GroupNorm", _C.FLOAT32, "group_norm (CUDA: fp32; CPU: a float32 kernel): Equinox GroupNorm"),
)
SCOPE_RULES: dict[str, tuple[tuple[str, str, str], ...]] = {"gpu": _NORM_SCOPES, "cpu": _NORM_SCOPES}

# torch.amp entries that have no JAX primitive of their own, and what happens instead.
TORCH_ONLY_NOTES: tuple[tuple[str, str], ...] = (
    (
        "softmax (fp32 on CUDA)",
        "jax.nn.softmax is inlined: exp and reduce_sum are fp32 on the GPU list, "
        "so the division and the result are fp32",
    ),
    ("logsumexp (fp32 on CUDA)", "inlined: exp, reduce_sum and log are fp32 on the GPU list"),
    (
        "mse_loss, l1_loss, huber_loss, kl_div, ... (fp32)",
        "optax losses are plain jnp code: their reductions are reduce_sum (fp32 on the GPU list); "
        "keep a whole loss in float32 with a region rule or compute it outside autocast",
    ),
    (
        "binary_cross_entropy (banned on CUDA)",
        "no JAX op to ban: compute losses from logits with optax.sigmoid_binary_cross_entropy "
        "(the seed's advice, binary_cross_entropy_with_logits), never from sigmoid outputs",
    ),
    ("batch_norm (not listed on CUDA)", "runs in the input dtype; its reduce_sum is fp32 on the GPU list"),
    ("prelu (lower precision)", "elementwise in JAX: runs in the input dtype"),
    ("lstm_cell, gru_cell, rnn_*_cell", "their matmuls are dot_generals: compute dtype"),
    ("index_put, scatter_add (promote on CUDA)", "scatter primitives keep their recorded dtypes (default rule)"),
)


def categories_for(oplist: str) -> dict[str, str]:
    """primitive name -> category for the ``"gpu"`` or ``"cpu"`` list."""
    return {prim: getattr(row, oplist) for row in OP_TABLE for prim in row.primitives}
