"""The frameworks whose objects autocast treats specially, looked up, never imported.

A program that holds an NNX object or an Equinox module has imported its framework already; jamp does not
import either (nor make them dependencies) to find out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def flax_nnx() -> Any:
    """``flax.nnx`` if the program imported it, else None."""
    return sys.modules.get("flax.nnx")


def equinox_module_type() -> type | None:
    """``equinox.Module`` if the program imported Equinox, else None."""
    equinox = sys.modules.get("equinox")
    return None if equinox is None else equinox.Module


def bound_module(fun: Any, module_type: type | None) -> tuple[Any, Callable] | None:
    """``(module, unbound method)`` when ``fun`` is an instance of ``module_type`` (called through its
    ``__call__``) or a method bound to one, else None."""
    if module_type is None:
        return None
    if isinstance(fun, module_type):
        return fun, type(fun).__call__
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, module_type) and hasattr(fun, "__func__"):
        return owner, fun.__func__
    return None
