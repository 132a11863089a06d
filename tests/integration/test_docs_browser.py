"""The built site reads whole in a browser, offline, on a phone (390 px) and on a laptop (1280 px).

Every page of ``mkdocs build`` is opened in one headless Chromium (tests/browser.py), served from
127.0.0.1, at both widths; tests/data/page_probe.js lists what a reader cannot see there:

* content cut by a box with hidden overflow, or spilling past the content column's right edge;
* at 1280 px, anything that needs a horizontal scrollbar (a table wider than the column, a code line
  longer than it); at 390 px a table or a code block may scroll inside its own box;
* code that soft-wraps inside a name (only ```text output wraps);
* a diagram left as its source text (a mermaid block whose script never loaded).

The page may request nothing but the local server: the site must work without a network (no web fonts,
no script from a CDN).

Skipped without Chromium (CI installs Debian's ``chromium``: .ci/run) or the ``docs`` extra.
``JAMP_DOCS_SCREENSHOTS=DIR`` also saves a full-page PNG of every page at both widths into DIR.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import browser
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (Path(__file__).resolve().parents[1] / "data" / "page_probe.js").read_text()
WIDTHS = {390: 844, 1280: 900}  # CSS pixels: a phone (iPhone 12 to 15) and a laptop, with their heights
LOCAL_SCHEMES = ("data:", "blob:", "about:")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed: pip install -e '.[docs]'")
    if browser.chromium_path() is None:
        pytest.skip("no chromium on the PATH (apt-get install chromium); .ci/run installs it")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def _pages(site: Path) -> list[str]:
    """The site's pages as paths under its root ('' for the home page)."""
    return sorted(str(p.parent.relative_to(site)).replace(".", "") for p in site.rglob("index.html"))


def test_every_page_reads_whole_offline_at_390_and_1280_px(site):
    shots = os.environ.get("JAMP_DOCS_SCREENSHOTS")
    chrome = browser.Browser(browser.chromium_path())
    base, server = browser.serve(site)
    problems = []
    try:
        pages = _pages(site)
        assert len(pages) >= 15, pages
        for page in pages:
            for width, height in WIDTHS.items():
                chrome.open(base + (page + "/" if page else ""), width, height)
                found = chrome.evaluate(f"({PROBE})({str(width >= 1000).lower()})")
                found += [
                    {"kind": "requested from the network", "px": 0, "where": "", "what": url}
                    for url in chrome.requests()
                    if not url.startswith(base) and not url.startswith(LOCAL_SCHEMES)
                ]
                problems += [{"page": page or "index", "width": width, **p} for p in found]
                if shots:
                    chrome.screenshot(Path(shots) / f"{(page or 'index').replace('/', '_')}-{width}.png")
    finally:
        chrome.close()
        server.shutdown()
    lines = [
        f"{p['page']} @ {p['width']} px: {p['kind']}"
        + (f", {p['px']} px" if p["px"] else "")
        + f" [{p['where']}] {p['what']}"
        for p in problems
    ]
    assert not problems, f"{len(problems)} things a reader cannot see:\n" + "\n".join(lines)
