"""Fused gradient unscale + non-finite check (torch's ``_amp_foreach_non_finite_check_and_unscale_``)."""

from jamp_kernels.dispatch import BACKENDS, has_nonfinite, unscale_and_check
from jamp_kernels.leafwise import inverse
from jamp_kernels.xla import unscale

__all__ = ["BACKENDS", "has_nonfinite", "inverse", "unscale", "unscale_and_check"]
