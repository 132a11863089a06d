// What a reader of this page cannot see; tests/integration/test_docs_browser.py evaluates this in every page of the
// built site at 390 and 1280 CSS pixels. Returns a list of {kind, px, where, what}; the page reads whole
// when it is empty. `wide` is true at 1280 px, where nothing may hide behind a scrollbar either.
(wide) => {
  const problems = [];
  const content = document.querySelector(".md-content");
  if (!content) return [{ kind: "no .md-content", px: 0, where: "", what: document.title }];
  const limit = content.getBoundingClientRect().right;

  const heading = (el) => {
    // The heading above an element: where to look for it on the page.
    const all = [...content.querySelectorAll("h1, h2, h3, h4")];
    let last = all[0];
    for (const h of all) {
      if (h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING) last = h;
    }
    return last ? last.textContent.replace("¶", "").trim().slice(0, 60) : "";
  };
  const describe = (el) => {
    const cls = typeof el.className === "string" && el.className ? "." + el.className.trim().split(/\s+/).join(".") : "";
    return `<${el.tagName.toLowerCase()}${cls}> ${el.textContent.replace(/\s+/g, " ").trim().slice(0, 50)}`;
  };
  const report = (kind, px, el) => problems.push({ kind, px: Math.round(px), where: heading(el), what: describe(el) });
  const clips = (style) => style.overflowX !== "visible";
  const scrolls = (style) => style.overflowX === "auto" || style.overflowX === "scroll";

  // 1. The page itself wider than the window: on a phone it pans sideways, or its right part is cut.
  const page = document.documentElement;
  if (page.scrollWidth > page.clientWidth + 1) {
    problems.push({ kind: "page wider than the window", px: page.scrollWidth - page.clientWidth, where: "", what: "" });
  }

  // 2. Boxes whose content is wider than the box: cut (overflow hidden or clip), behind a scrollbar
  //    (allowed on a phone only), or spilling past the content column's right edge (overflow visible).
  const spilling = [];
  for (const el of content.querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.display === "none" || style.visibility === "hidden") continue;
    const hidden = el.scrollWidth - el.clientWidth;
    if (el.clientWidth > 0 && hidden > 1 && clips(style)) {
      if (!scrolls(style)) report("cut (overflow hidden)", hidden, el);
      else if (wide) report("hidden behind a scrollbar", hidden, el);
      continue;
    }
    let clipped = false;
    for (let a = el.parentElement; a && a !== content; a = a.parentElement) {
      if (clips(getComputedStyle(a))) {
        clipped = true;
        break;
      }
    }
    if (clipped) continue; // measured at the clipping box
    const rect = el.getBoundingClientRect();
    const right = Math.max(rect.right, el.clientWidth > 0 ? rect.left + el.scrollWidth : rect.right);
    if (rect.width > 0 && right > limit + 1) spilling.push([el, right - limit]);
  }
  for (const [el, px] of spilling) {
    if (!spilling.some(([other]) => other !== el && el.contains(other))) report("past the right edge", px, el);
  }

  // 3. Code that soft-wraps: every block but printed output (```text wraps on purpose). A wrapped Python
  //    line reads as a wrong indentation; a name cut in two ("softmax_cross_entropy_wi" / "th_integer")
  //    is worse, and counted apart.
  for (const code of content.querySelectorAll(".highlight:not(.language-text) pre > code")) {
    const cut = [];
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const match of node.data.matchAll(/\w{2,}/g)) {
        const range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const tops = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (tops.size > 1) cut.push(match[0]);
      }
    }
    const style = getComputedStyle(code);
    const padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
    const shown = Math.round((code.scrollHeight - padding) / parseFloat(style.lineHeight));
    const written = code.textContent.replace(/\n$/, "").split("\n").length;
    if (cut.length) report(`code wrapped inside ${cut.length} names (${cut.slice(0, 3).join(", ")})`, 0, code);
    else if (shown > written) report(`code wraps: ${written} lines shown as ${shown}`, 0, code);
  }

  // 4. Diagrams: a mermaid block nobody rendered, or diagram source shown as text.
  for (const el of content.querySelectorAll(".mermaid")) {
    if (!el.querySelector("svg") && !(el.shadowRoot && el.shadowRoot.querySelector("svg"))) {
      report("diagram shown as source", 0, el);
    }
  }
  for (const code of content.querySelectorAll("pre > code")) {
    if (!code.closest(".mermaid") && /^\s*(flowchart|graph|sequenceDiagram|classDiagram|stateDiagram)\b/.test(code.textContent)) {
      report("diagram shown as source", 0, code);
    }
  }
  // 5. Diagrams drawn at build time (docs/hooks/diagrams.py sizes boxes for a monospace font without measuring):
  //    every text inside its box, no arrow label over a box, text no smaller than 8 px once scaled.
  const overlap = (a, b) => a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
  for (const svg of content.querySelectorAll("svg.jamp-diagram")) {
    const boxes = [...svg.querySelectorAll(".node")].map((g) => [g, g.querySelector("rect, polygon").getBBox()]);
    for (const [g, shape] of boxes) {
      const text = g.querySelector("text").getBBox();
      const out = Math.max(shape.x - text.x, text.x + text.width - shape.x - shape.width, shape.y - text.y,
        text.y + text.height - shape.y - shape.height);
      if (out > 0.5) report("diagram text outside its box", out, g);
    }
    for (const label of svg.querySelectorAll(".label text")) {
      const at = label.getBBox();
      for (const [g, shape] of boxes) if (overlap(at, shape)) report("diagram label over a box", 0, label);
    }
    const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
    const size = scale * parseFloat(svg.getAttribute("font-size"));
    if (size < 8) report(`diagram text ${size.toFixed(1)} px high`, 0, svg);
  }
  return problems;
}
