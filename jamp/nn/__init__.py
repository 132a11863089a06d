"""Fused attention that autocast runs in the compute dtype: ``jamp.nn.dot_product_attention``.

torch's ``scaled_dot_product_attention`` under autocast runs its flash kernel in the autocast dtype, so a
float32 model gets flash attention. JAX's cuDNN kernel refuses float32 while it is traced; wrapped with
:func:`jamp.lower_precision`, the call is traced in the region's compute dtype instead, and the
implementation is picked for the dtype it is traced with: cuDNN's flash attention where the backend is
CUDA and the kernel supports the call (the conditions JAX checks), else XLA's. Outside autocast the same
call runs on the dtypes it is given (a float32 model: XLA's implementation, as ``jax.nn``'s default).
Either way it runs on every backend: XLA's float16 attention asks for a dot algorithm that JAX's lowering
for a CPU refuses, and jamp binds that dot so that each platform gets a form it accepts
(:mod:`jamp.casting.portable_dots`).

The adapters give flax's attention modules (``attention_fn=``) and Equinox's ``MultiheadAttention`` the
same call.
"""

from jamp.nn.adapters import equinox_multihead_attention, flax_dot_product_attention
from jamp.nn.attention import cudnn_refusal, dot_product_attention

__all__ = ["cudnn_refusal", "dot_product_attention", "equinox_multihead_attention", "flax_dot_product_attention"]
