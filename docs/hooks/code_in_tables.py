"""mkdocs hook: code in a table cell may break after punctuation, never inside a short name.

A browser breaks code only at spaces, or anywhere once ``overflow-wrap`` allows it: either a column
grows to the longest call written in it and the table no longer fits the page, or a narrow column
splits ``enabled=False`` into ``enabled=Fa`` / ``lse``. A ``<wbr>`` after each ``(``, ``,``, ``.``,
``=``, ``/`` or ``[`` in the cells' inline code, and after the underscores of a long name
(``regularized_incomplete_beta``), gives the browser those places to break; copying the code copies
no extra character. docs/stylesheets/extra.css turns the break-anywhere rule off.
"""

from __future__ import annotations

import re

TABLE = re.compile(r"<table\b.*?</table>", re.S)
INLINE_CODE = re.compile(r"<code>([^<]*)</code>")
# not before a closing bracket or inside "...", nor at a number's decimal point ("2.0**15")
BREAK_AFTER = re.compile(r"([(,=/\[]|(?<!\d)\.)(?=[^\s)\].])")
LONG_NAME = re.compile(r"\w{14,}")  # longer than device_type or cache_enabled
INNER_UNDERSCORE = re.compile(r"(?<=[^\W_])_(?=[^\W_])")


def with_breaks(code: str) -> str:
    """Escaped inline code with a ``<wbr>`` at each place it may break (HTML entities such as ``&quot;``
    hold none of these marks, so they stay whole)."""
    code = LONG_NAME.sub(lambda name: INNER_UNDERSCORE.sub("_<wbr>", name[0]), code)
    return BREAK_AFTER.sub(r"\1<wbr>", code)


def on_page_content(html: str, **kwargs) -> str:
    return TABLE.sub(lambda table: INLINE_CODE.sub(lambda m: f"<code>{with_breaks(m[1])}</code>", table[0]), html)
