"""What autocast and the scaler both say about a bad argument: its value, shown short, and the bool check."""

from __future__ import annotations

from typing import Any

import numpy as np


def shown(value: Any, width: int = 40) -> str:
    """``repr(value)`` cut to ``width`` characters, so an error about ``10**400`` stays one line."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 12]}...({len(text)} chars)"


def checked_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; a TypeError naming ``name`` otherwise (``enabled="no"`` is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {shown(value)} of type {type(value).__name__}")
    return bool(value)
