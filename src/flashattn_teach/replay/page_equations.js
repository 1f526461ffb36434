// The equations panel of the forward view (trace/equations.py): FA2 Alg. 1's lines at this tile update with
// their numbers, one query row of the block in full; the row buttons (or a select, for many rows) show the others.
// The numbers come from the case's "equations" (the JSON's extensions), written by Page.substituted
// (Page.fmt, −∞ for null); a key-major replay's view lists FA1 Alg. 1's lines per update in "steps", shown instead.
(() => {
  const {el, substituted} = Page;
  // {source, rowStart, rowCount}, key-major also {note, steps}; absent: the replay has no update
  const view = Page.views.equations;
  if (!view) return;
  const MAX_BUTTONS = 16;  // more rows than this: a select instead of one button per row
  let row = 0;  // the row shown in full, kept while stepping

  function picker(eq, redraw) {
    const label = r => `row ${eq.rowStart + r}`;
    if (eq.rows.length > MAX_BUTTONS) {
      const select = el("select", {id: "equation-row", attrs: {"aria-label": "query row shown in full"}},
        ...eq.rows.map((_, r) => el("option", {value: String(r), textContent: label(r), selected: r === row})));
      select.addEventListener("change", () => { row = Number(select.value); redraw("#equation-row"); });
      return el("div", {className: "equation-rows"}, select);
    }
    const box = el("div", {className: "equation-rows", attrs: {role: "group", "aria-label": "query row shown in full"}});
    eq.rows.forEach((_, r) => {
      const b = el("button", {type: "button", textContent: label(r), dataset: {row: r}});
      b.setAttribute("aria-pressed", String(r === row));
      b.addEventListener("click", () => { row = r; redraw(`.equation-rows button[data-row="${r}"]`); });
      box.append(b);
    });
    return box;
  }

  function draw(body, c, index) {
    body.replaceChildren();
    const eq = view.steps ? view.steps[index] : c.equations;
    if (!eq || !eq.rows.length) return;
    row = Math.min(row, eq.rows.length - 1);
    const redraw = focus => { draw(body, c, index); body.querySelector(focus).focus(); };
    const list = el("div", {className: "equations", dataset: {row: eq.rowStart + row}});
    for (const e of eq.rows[row]) {
      const box = el("div", {className: "equation", dataset: {name: e.name, line: e.line}},
        el("span", {className: "line", textContent: `line ${e.line}`}),
        el("code", {className: "symbolic", textContent: e.symbolic}),
        el("div", {className: "substituted"}, ...substituted(e.parts)));
      if (e.note) box.append(el("div", {className: "note", textContent: e.note}));
      list.append(box);
    }
    if (view.note) body.append(el("p", {className: "meta equation-order", textContent: view.note}));
    body.append(el("p", {className: "meta", textContent: `${view.source}; row ${eq.rowStart + row} of the block ` +
      `(rows ${eq.rowStart}–${eq.rowStart + eq.rows.length - 1}) with this update's numbers:`}), picker(eq, redraw), list);
  }

  Page.addForwardPanel("equations", "Equations with their numbers", draw);
})();
