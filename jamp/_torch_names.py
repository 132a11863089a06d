"""What to write in jamp for the torch.amp names a PyTorch user tries first.

``jamp.GradScaler()`` is a habit, not a typo, so the error says what the jamp form is instead of only that the
name is missing (the habits of autocast's and the scaler's arguments and methods are answered where they are:
:mod:`jamp.casting.torch_habits`, :mod:`jamp.scaling.transformation`). The names are torch.amp's public API (torch 2.x
``torch.amp``/``torch.autocast``, the 1.x ``torch.cuda.amp`` aliases) and the loss-scaling names of the
JAX libraries people come from (jmp, flax); docs/torch-amp.md maps every API side by side.
"""

from __future__ import annotations

import sys

_SCALER = (
    "the scaler is an optax transformation that wraps your optimizer: tx = jamp.scaler(optax.adam(1e-3)), "
    "opt_state = tx.init(params); in each step differentiate jamp.scale(loss, opt_state) (torch's "
    "scaler.scale(loss).backward()), then updates, opt_state = tx.update(grads, opt_state, params) "
    "unscales, checks for inf/NaN, steps or skips and moves the scale (scaler.step and scaler.update)"
)
_NO_GLOBAL_STATE = (
    "jamp keeps no global autocast state: autocast is a function transformation, and what it "
    "runs in which dtype is an argument, jamp.autocast(fn, device_type='gpu', dtype=jnp.float16). "
    "To see the dtypes: jamp.explain(fn, device_type='gpu')(*args); the default dtype of a "
    "device: jamp.get_policy('gpu').compute_dtype"
)
_AUTOCAST = "jamp.autocast(fn, device_type='gpu', dtype=jnp.float16) or @jamp.autocast(device_type='gpu')"

# name looked up on the jamp module -> what to write instead
MODULE_NAMES: dict[str, str] = {
    "GradScaler": f"jamp has no GradScaler class; {_SCALER}",
    "ShardedGradScaler": (
        f"jamp has no ShardedGradScaler; {_SCALER}. Under jax.jit with sharded arrays the "
        "check covers the global gradients; under pmap/shard_map pass "
        "jamp.scaler(optimizer, axis_name=...)"
    ),
    "custom_bwd": (
        "not needed: the backward rule of a jax.custom_vjp runs under the same autocast state as its "
        "forward; decorate the custom_vjp function with jamp.custom_fwd(fn, cast_inputs=jnp.float32) "
        "to run both in one precision"
    ),
    "amp": f"jamp is torch.amp: torch.amp.autocast is {_AUTOCAST}, torch.amp.GradScaler is jamp.scaler(optimizer)",
    "autocast_mode": f"torch.amp.autocast_mode.autocast is {_AUTOCAST}",
    "grad_scaler": "torch.amp.grad_scaler.GradScaler is jamp.scaler(optimizer)",
    "cuda": f"jamp has no per-device modules: torch.cuda.amp.autocast is {_AUTOCAST}, "
    "torch.cuda.amp.GradScaler is jamp.scaler(optimizer)",
    "cpu": "jamp has no per-device modules: torch.cpu.amp.autocast is jamp.autocast(fn, device_type='cpu') "
    "(bfloat16 by default)",
    "is_autocast_available": (
        "every device_type ('gpu'/'cuda', 'cpu', 'tpu') is available: a policy picks op "
        "lists and never checks which hardware is present"
    ),
    **dict.fromkeys(
        (
            "is_autocast_enabled",
            "set_autocast_enabled",
            "get_autocast_dtype",
            "set_autocast_dtype",
            "get_autocast_gpu_dtype",
            "set_autocast_gpu_dtype",
            "get_autocast_cpu_dtype",
            "set_autocast_cpu_dtype",
            "is_autocast_cpu_enabled",
            "set_autocast_cpu_enabled",
            "is_autocast_cache_enabled",
            "set_autocast_cache_enabled",
            "clear_autocast_cache",
        ),
        _NO_GLOBAL_STATE,
    ),
    # jmp and flax
    **dict.fromkeys(
        ("DynamicLossScale", "StaticLossScale", "DynamicScale"),
        f"jamp's dynamic loss scaling is jamp.scaler(optimizer); {_SCALER}",
    ),
    **dict.fromkeys(
        ("all_finite", "select_tree"),
        "not needed: tx = jamp.scaler(optimizer) checks the gradients and skips the step in tx.update",
    ),
}


def missing_attribute(name: str) -> AttributeError:
    """The error for ``jamp.<name>``: what to write instead for a torch.amp name, Python's own message otherwise
    (``name`` and ``obj`` set, so Python still suggests a close spelling)."""
    module = sys.modules["jamp"]
    hint = MODULE_NAMES.get(name)
    message = f"jamp.{name}: {hint}" if hint else f"module 'jamp' has no attribute {name!r}"
    return AttributeError(message, name=name, obj=module)
