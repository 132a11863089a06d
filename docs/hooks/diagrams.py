"""mkdocs hook: a ```diagram block becomes an inline SVG of boxes and arrows, drawn at build time.

The site loads no script to draw it (a mermaid diagram needs one from a CDN and shows its source
without a network). The description is one statement a line::

    title: what the diagram shows (read aloud by screen readers)
    box F at 0,0: user function
    box J at 0,1: jaxpr | (float32 as written)
    decision D at 0,2: inf/NaN?
    F -> J: jax.make_jaxpr | (nested autocasts
    J -> D

``box NAME at COLUMN,ROW: TEXT`` places a box in a grid, ``decision`` a diamond; ``|`` breaks a line; a line
that starts with ``#`` is a comment.
``A -> B: LABEL`` draws an arrow, the label optional. Columns are as wide as their widest box; the gap
under a row grows with the labels of the arrows that cross it. An arrow between boxes of one column
or one row is straight, with its label beside (vertical) or above (horizontal) it; any other turns
one corner, avoiding boxes. Text is set in the theme's monospace font, whose characters are
``CHAR_WIDTH`` of the font size wide, so the boxes are sized without measuring (tests/integration/test_docs_browser.py
checks in a browser that every text fits its box). docs/stylesheets/extra.css colours it for both
palettes.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

FONT_SIZE = 13  # px
# Monospace fonts (Roboto Mono, DejaVu Sans Mono, Menlo, Consolas): 0.6 em a character.
CHAR_WIDTH = 0.6 * FONT_SIZE
LINE_HEIGHT = 1.3 * FONT_SIZE
PAD_X, PAD_Y = 10, 7  # inside a box
COLUMN_GAP, MIN_ROW_GAP, LABEL_GAP = 28, 26, 8
MARGIN = 4

FENCE = re.compile(r"^```diagram[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
BOX = re.compile(r"^(?P<kind>box|decision)\s+(?P<name>\w+)\s+at\s+(?P<col>\d+)\s*,\s*(?P<row>\d+)\s*:\s*(?P<text>.+)$")
ARROW = re.compile(r"^(?P<src>\w+)\s*->\s*(?P<dst>\w+)\s*(?::\s*(?P<label>.+))?$")


@dataclass
class Box:
    name: str
    kind: str
    col: int
    row: int
    lines: list[str]
    x: float = 0.0  # centre
    y: float = 0.0
    w: float = 0.0
    h: float = 0.0

    def rect(self) -> tuple[float, float, float, float]:
        return (self.x - self.w / 2, self.y - self.h / 2, self.x + self.w / 2, self.y + self.h / 2)


@dataclass
class Arrow:
    src: str
    dst: str
    lines: list[str]
    points: list[tuple[float, float]] = field(default_factory=list)
    label_at: tuple[float, float, str] | None = None  # x, y of the first line's baseline, text-anchor


def _lines(text: str) -> list[str]:
    return [part.strip() for part in text.split("|")]


def _text_size(lines: list[str]) -> tuple[float, float]:
    return max(len(line) for line in lines) * CHAR_WIDTH, len(lines) * LINE_HEIGHT


def parse(source: str) -> tuple[str, dict[str, Box], list[Arrow]]:
    """The title, the boxes by name and the arrows of a description; ValueError names a bad line."""
    title, boxes, arrows = "", {}, []
    for number, raw in enumerate(source.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("title:"):
            title = line.removeprefix("title:").strip()
        elif m := BOX.match(line):
            if m["name"] in boxes:
                raise ValueError(f"diagram line {number}: box {m['name']} defined twice")
            boxes[m["name"]] = Box(m["name"], m["kind"], int(m["col"]), int(m["row"]), _lines(m["text"]))
        elif m := ARROW.match(line):
            arrows.append(Arrow(m["src"], m["dst"], _lines(m["label"]) if m["label"] else []))
        else:
            raise ValueError(f"diagram line {number}: neither a box nor an arrow: {raw!r}")
    for arrow in arrows:
        for end in (arrow.src, arrow.dst):
            if end not in boxes:
                raise ValueError(f"diagram: arrow {arrow.src} -> {arrow.dst} names no box {end}")
    cells = [(b.col, b.row) for b in boxes.values()]
    if len(set(cells)) != len(cells):
        raise ValueError("diagram: two boxes in one cell")
    return title, boxes, arrows


def _size(box: Box) -> None:
    w, h = _text_size(box.lines)
    if box.kind == "decision":  # a rhombus through twice the half-extents of the text's rectangle
        box.w, box.h = 2 * w + 4 * PAD_Y, 2 * h + 2 * PAD_Y
    else:
        box.w, box.h = w + 2 * PAD_X, h + 2 * PAD_Y


def _clip(box: Box, toward: tuple[float, float]) -> tuple[float, float]:
    """Where the segment from the box's centre toward a point leaves the box."""
    dx, dy = toward[0] - box.x, toward[1] - box.y
    a, b = box.w / 2, box.h / 2
    if box.kind == "decision":
        t = 1 / (abs(dx) / a + abs(dy) / b)
    else:
        t = min(a / abs(dx) if dx else float("inf"), b / abs(dy) if dy else float("inf"))
    return box.x + t * dx, box.y + t * dy


def _crosses(p: tuple[float, float], q: tuple[float, float], box: Box) -> bool:
    """Whether an axis-parallel segment p-q passes through the box."""
    x0, y0, x1, y1 = box.rect()
    lo_x, hi_x, lo_y, hi_y = (min(p[0], q[0]), max(p[0], q[0]), min(p[1], q[1]), max(p[1], q[1]))
    return lo_x < x1 and hi_x > x0 and lo_y < y1 and hi_y > y0


def layout(boxes: dict[str, Box], arrows: list[Arrow]) -> tuple[float, float]:
    """Place boxes and route arrows; the drawing's width and height."""
    for box in boxes.values():
        _size(box)
    cols = max(b.col for b in boxes.values()) + 1
    rows = max(b.row for b in boxes.values()) + 1
    col_w = [max((b.w for b in boxes.values() if b.col == c), default=0) for c in range(cols)]
    row_h = [max((b.h for b in boxes.values() if b.row == r), default=0) for r in range(rows)]
    gap = [MIN_ROW_GAP] * rows
    for arrow in arrows:
        src, dst = boxes[arrow.src], boxes[arrow.dst]
        if arrow.lines and abs(src.row - dst.row) == 1:
            gap[min(src.row, dst.row)] = max(gap[min(src.row, dst.row)], _text_size(arrow.lines)[1] + 2 * LABEL_GAP)
    col_x = [MARGIN + sum(col_w[:c]) + COLUMN_GAP * c for c in range(cols)]
    row_y = [MARGIN + sum(row_h[:r]) + sum(gap[:r]) for r in range(rows)]
    for box in boxes.values():
        box.x, box.y = (col_x[box.col] + col_w[box.col] / 2, row_y[box.row] + row_h[box.row] / 2)
    right = MARGIN + sum(col_w) + COLUMN_GAP * (cols - 1)
    for arrow in arrows:
        right = max(right, _route(arrow, boxes[arrow.src], boxes[arrow.dst], boxes))
    return right + MARGIN, row_y[-1] + row_h[-1] + MARGIN


def _route(arrow: Arrow, src: Box, dst: Box, boxes: dict[str, Box]) -> float:
    """Set the arrow's points and label position; the label's right edge."""
    if src.col == dst.col or src.row == dst.row:
        arrow.points = [_clip(src, (dst.x, dst.y)), _clip(dst, (src.x, src.y))]
    else:
        others = [b for b in boxes.values() if b is not src and b is not dst]
        corner = (dst.x, src.y)  # across first, then down or up
        if any(_crosses((src.x, src.y), corner, b) or _crosses(corner, (dst.x, dst.y), b) for b in others):
            corner = (src.x, dst.y)  # down or up first, then across
        arrow.points = [_clip(src, corner), corner, _clip(dst, corner)]
    if not arrow.lines:
        return 0.0
    w, h = _text_size(arrow.lines)
    segments = list(zip(arrow.points, arrow.points[1:]))
    (x0, y0), (x1, y1) = max(segments, key=lambda s: abs(s[0][0] - s[1][0]) + abs(s[0][1] - s[1][1]))
    if abs(x1 - x0) > abs(y1 - y0):  # horizontal: above the line, centred
        arrow.label_at = ((x0 + x1) / 2, (y0 + y1) / 2 - LABEL_GAP / 2 - h + FONT_SIZE, "middle")
        return (x0 + x1) / 2 + w / 2
    x = max(x0, x1) + LABEL_GAP  # vertical: to the right, centred on it
    arrow.label_at = (x, (y0 + y1) / 2 - h / 2 + FONT_SIZE * 0.95, "start")
    return x + w


def label_rect(arrow: Arrow) -> tuple[float, float, float, float] | None:
    """The rectangle the arrow's label covers (left, top, right, bottom), as set by :func:`layout`."""
    if arrow.label_at is None:
        return None
    x, y, anchor = arrow.label_at
    w, h = _text_size(arrow.lines)
    left = x - w / 2 if anchor == "middle" else x
    return left, y - FONT_SIZE * 0.95, left + w, y - FONT_SIZE * 0.95 + h


def _text(lines: list[str], x: float, y: float, anchor: str) -> str:
    spans = "".join(
        f'<tspan x="{x:.1f}" dy="{0 if i == 0 else LINE_HEIGHT:.1f}">{html.escape(line)}</tspan>'
        for i, line in enumerate(lines)
    )
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{spans}</text>'


def svg(source: str, ident: str = "diagram") -> str:
    """The SVG of a description, on one line (markdown keeps a raw HTML block whole until a blank line)."""
    title, boxes, arrows = parse(source)
    width, height = layout(boxes, arrows)
    parts = [
        f'<svg class="jamp-diagram" xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {width:.0f} {height:.0f}"'
        f' width="{width:.0f}" height="{height:.0f}" font-size="{FONT_SIZE}">',
        f"<title>{html.escape(title)}</title>" if title else "",
        f'<defs><marker id="{ident}-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7"'
        ' orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>',
    ]
    for box in boxes.values():
        x0, y0, x1, y1 = box.rect()
        if box.kind == "decision":
            shape = f'<polygon points="{box.x:.1f},{y0:.1f} {x1:.1f},{box.y:.1f} {box.x:.1f},{y1:.1f} {x0:.1f},{box.y:.1f}"/>'
        else:
            shape = f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" rx="3"/>'
        top = box.y - len(box.lines) * LINE_HEIGHT / 2 + FONT_SIZE * 0.95
        parts.append(f'<g class="node">{shape}{_text(box.lines, box.x, top, "middle")}</g>')
    for arrow in arrows:
        d = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in arrow.points)
        parts.append(f'<g class="edge"><path d="{d}" fill="none" marker-end="url(#{ident}-arrow)"/></g>')
        if arrow.label_at:
            x, y, anchor = arrow.label_at
            parts.append(f'<g class="label">{_text(arrow.lines, x, y, anchor)}</g>')
    parts.append("</svg>")
    return "".join(parts)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    count = iter(range(1000))

    def replace(m: re.Match) -> str:
        ident = f"diagram-{next(count)}"
        return f'<div class="jamp-diagram-box">{svg(m["body"], ident)}</div>'

    return FENCE.sub(replace, markdown)
