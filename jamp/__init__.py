"""jamp: automatic mixed precision for JAX (torch.amp's autocast and GradScaler, the JAX way).

Four wings: :mod:`jamp.casting` (autocast, the jaxpr transformation), :mod:`jamp.scaling` (GradScaler
as an optax transformation), :mod:`jamp.low_precision_params` (Kahan-compensated and stochastically rounded
updates of float16/bfloat16 parameters) and :mod:`jamp.tools` (explain, find_overflow, collectives). This module is the
public face.
"""

import importlib

from jamp import nn
from jamp.casting.autocast import autocast
from jamp.casting.custom_fwd import custom_fwd
from jamp.casting.lower_precision import lower_precision
from jamp.casting.policy import Policy, get_policy
from jamp.low_precision_params.kahan import KahanSummationState, kahan_summation
from jamp.low_precision_params.stochastic import StochasticRoundingState, stochastic_rounding
from jamp.scaling.checkpoint import load_state_dict, state_dict
from jamp.scaling.lint import check_step
from jamp.scaling.loss_scale import found_inf, get_scale, scale, scaler_summary, set_scale, unscale, value_and_grad
from jamp.scaling.restore import from_restored
from jamp.scaling.scaler import scaler
from jamp.scaling.skip_report import SkippedStepsWarning, report_skipped_steps
from jamp.scaling.state import DisabledScalerState, ScalerState
from jamp.scaling.torch_methods import ScalerTransformation
from jamp.scaling.unscaled_grads import UnscaledGradientsWarning
from jamp.tools.collectives import Collective, collectives
from jamp.tools.explanation import OpRecord, Report, explain
from jamp.tools.overflow import Finding, find_overflow

__all__ = [
    # autocast
    "Policy",
    "autocast",
    "custom_fwd",
    "get_policy",
    "lower_precision",
    "nn",
    # gradient scaling
    "DisabledScalerState",
    "ScalerState",
    "ScalerTransformation",
    "SkippedStepsWarning",
    "UnscaledGradientsWarning",
    "check_step",
    "found_inf",
    "from_restored",
    "get_scale",
    "report_skipped_steps",
    "load_state_dict",
    "scale",
    "scaler",
    "scaler_summary",
    "set_scale",
    "state_dict",
    "unscale",
    "value_and_grad",
    # low-precision parameters
    "KahanSummationState",
    "StochasticRoundingState",
    "kahan_summation",
    "stochastic_rounding",
    # precision tools
    "Collective",
    "collectives",
    "Finding",
    "OpRecord",
    "Report",
    "explain",
    "find_overflow",
]


def __getattr__(name: str):
    """torch.amp's names (``jamp.GradScaler``, ``jamp.is_autocast_enabled``, ...) fail with what to write instead."""
    raise importlib.import_module("jamp._torch_names").missing_attribute(name)
