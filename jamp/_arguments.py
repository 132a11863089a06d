"""What autocast and the scaler both say about a bad argument: its value, shown short, and the bool check."""

from __future__ import annotations

from typing import Any

import numpy as np


def shown(value: Any, width: int = 40) -> str:
    """``repr(value)`` cut to ``width`` characters, so an error about ``10**400`` stays one line."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 12]}...({len(text)} chars)"


def checked_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; a TypeError naming ``name`` otherwise (``enabled="no"`` is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {shown(value)} of type {type(value).__name__}")
    return bool(value)


def checked_transformation(what: str, tx: Any) -> Any:
    """``tx`` if it has callable ``init`` and ``update`` (duck-typed as optax.chain does, so optax.MultiSteps fits);
    a TypeError naming ``what`` (e.g. "jamp.scaler's argument 0") otherwise."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{what} must be an optax.GradientTransformation (or have its init and update, as "
            f"optax.MultiSteps does), got {shown(tx)} of type {type(tx).__name__}"
        )
    return tx
