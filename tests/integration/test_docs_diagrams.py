"""docs/hooks/diagrams.py: the ```diagram blocks of the docs become SVG at build time, laid out without overlaps.

The browser test (tests/integration/test_docs_browser.py) checks the drawn result: every text inside its box at
390 and 1280 px. These checks need no browser.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
spec = importlib.util.spec_from_file_location("diagrams", DOCS / "hooks" / "diagrams.py")
diagrams = importlib.util.module_from_spec(spec)
sys.modules["diagrams"] = diagrams  # dataclasses look their module up
spec.loader.exec_module(diagrams)

SOURCES = [(p, m["body"]) for p in sorted(DOCS.rglob("*.md")) for m in diagrams.FENCE.finditer(p.read_text())]


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_how_it_works_has_a_diagram_and_no_page_needs_mermaid():
    assert any(p.name == "how-it-works.md" for p, _ in SOURCES)
    for page in DOCS.rglob("*.md"):
        assert not re.search(r"^\s*```mermaid", page.read_text(), re.M), f"{page}: mermaid loads a script from a CDN"


@pytest.mark.parametrize("source", [s for _, s in SOURCES], ids=[p.name for p, _ in SOURCES])
def test_layout_has_no_overlaps(source):
    _, boxes, arrows = diagrams.parse(source)
    width, height = diagrams.layout(boxes, arrows)
    rects = {name: box.rect() for name, box in boxes.items()}
    for a in rects:
        for b in rects:
            assert a == b or not _overlap(rects[a], rects[b]), (a, b)
    for arrow in arrows:
        label = diagrams.label_rect(arrow)
        if label is not None:
            hits = [n for n, r in rects.items() if _overlap(label, r)]
            assert not hits, f"the label of {arrow.src} -> {arrow.dst} covers {hits}"
            assert 0 <= label[0] and label[2] <= width and 0 <= label[1] and label[3] <= height
        for start, end in zip(arrow.points, arrow.points[1:]):
            crossed = [
                n for n, box in boxes.items() if n not in (arrow.src, arrow.dst) and diagrams._crosses(start, end, box)
            ]
            assert not crossed, f"{arrow.src} -> {arrow.dst} runs through {crossed}"
    svg = diagrams.svg(source)
    assert "\n" not in svg  # markdown ends a raw HTML block at a blank line
    for box in boxes.values():
        for line in box.lines:
            assert f">{line.replace('&', '&amp;')}<" in svg


def test_a_corner_turns_around_a_box():
    source = "box A at 1,0: a\nbox B at 0,1: b\nbox C at 0,0: c\nA -> B\nC -> A"
    _, boxes, arrows = diagrams.parse(source)
    diagrams.layout(boxes, arrows)
    a_to_b = arrows[0].points
    assert len(a_to_b) == 3 and a_to_b[1] == (boxes["A"].x, boxes["B"].y)  # down first: across would hit C
    assert len(arrows[1].points) == 2  # one row: straight
    _, boxes, arrows = diagrams.parse(source.replace("at 0,0: c", "at 2,2: c"))
    diagrams.layout(boxes, arrows)
    assert arrows[0].points[1] == (boxes["B"].x, boxes["A"].y)  # across first when nothing is in the way


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("box A at 0,0: a\nA -> Z", "names no box Z"),
        ("box A at 0,0: a\nbox B at 0,0: b", "two boxes in one cell"),
        ("box A at 0,0: a\nA => A", "line 2: neither a box nor an arrow"),
        ("box A at 0,0: a\nbox A at 0,1: b", "box A defined twice"),
    ],
)
def test_a_bad_description_names_its_line(source, message):
    with pytest.raises(ValueError, match=message):
        diagrams.parse(source)


def test_a_page_gets_its_svg_and_loses_the_source():
    page = "Before.\n\n```diagram\nbox A at 0,0: start\nbox B at 0,1: end\nA -> B: go\n```\n\nAfter.\n"
    out = diagrams.on_page_markdown(page, page=None)
    assert "```" not in out and out.count("<svg") == 1 and "Before." in out and "After." in out
    assert 'marker-end="url(#diagram-0-arrow)"' in out
