"""One form of a computation per platform, chosen when the program is lowered (``lax.platform_dependent``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax


def per_platform(forms: Mapping[str, Callable], *args: Any) -> Any:
    """``forms[platform](*args)`` for the platform the program is lowered for, ``forms["default"]`` elsewhere.

    One entry (a table forced to ``{"default": form}`` by a benchmark or a test) is called as it is, with no
    conditional in the program. Several become one flat ``lax.platform_dependent``: each form is traced once and
    only the lowered platform's is compiled.

    Args:
        forms: platform name ("cpu", "cuda", "rocm", "tpu") or "default" -> a function of ``args``.
        *args: what each form takes.

    Returns:
        What the chosen form returns.

    Example:
        >>> import jax.numpy as jnp
        >>> from jamp_kernels.platforms import per_platform
        >>> per_platform({"default": jnp.negative}, jnp.ones(2))
        Array([-1., -1.], dtype=float32)
    """
    if set(forms) == {"default"}:
        return forms["default"](*args)
    return jax.lax.platform_dependent(*args, **forms)
