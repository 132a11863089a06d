"""Source locations at human size: ``flax/linen/linear.py:287 (Dense.__call__)`` rather than the
absolute path through a virtual environment."""

from __future__ import annotations

import functools
import os
import re
import sys

_LOCATION = re.compile(r"(?P<file>.+):(?P<line>\d+)(?P<rest>( \(.*\))?)")


@functools.lru_cache(maxsize=4096)
def _relative(file: str, roots: tuple[str, ...]) -> str:
    for root in roots:  # longest first: site-packages wins over a cwd that holds the venv
        if file.startswith(root + os.sep):
            return file[len(root) + 1 :]
    return file


def short_path(file: str) -> str:
    """``file`` relative to the longest of the current directory and the ``sys.path`` entries holding it:
    ``flax/linen/linear.py`` for an installed package, ``examples/model.py`` for the user's own code."""
    roots = {os.getcwd(), *(os.path.abspath(p) for p in sys.path if p)}
    return _relative(os.path.abspath(file), tuple(sorted(roots, key=len, reverse=True)))


def short_source(source: str) -> str:
    """A ``'file:line (function)'`` location (``OpRecord.source``, ``Finding.source``) with a short path."""
    m = _LOCATION.fullmatch(source)
    return f"{short_path(m['file'])}:{m['line']}{m['rest']}" if m else source


def fitted_source(source: str, width: int = 40) -> str:
    """:func:`short_source` with its directories cut from the left (``…/linen/linear.py:287 (Dense.__call__)``)
    until its ``file:line`` fits ``width`` characters: a table shows the file and line whole, however narrow."""
    short = short_source(source)
    m = _LOCATION.fullmatch(short)
    if m is None or len(f"{m['file']}:{m['line']}") <= width:
        return short
    *dirs, tail = m["file"].split(os.sep)
    for part in reversed(dirs):
        if len(f"…{os.sep}{part}{os.sep}{tail}:{m['line']}") > width:
            break
        tail = f"{part}{os.sep}{tail}"
    return f"…{os.sep}{tail}:{m['line']}{m['rest']}"
