// The kernel panel of the forward view (kernel_view.py), for a replay with source="triton": at each tile update,
// per traced term and query row, the reference's numbers, the kernel's (core/kernel.py's trace, in base e) and
// the largest difference between them; eight significant digits, since what differs is in the last ones.
// The numbers are the case's "kernel" (the JSON's); the note says what explains the differences.
(() => {
  const {el} = Page;
  const view = Page.views.kernel;  // {source, blockM, blockN, tiles, note, rowStart}; absent: no kernel ran
  if (!view) return;
  const digits = x => x === null ? "−∞" : Number(x).toPrecision(8);
  const rows = v => Array.isArray(v) ? v : [v];
  const flat = v => Array.isArray(v) ? v.flatMap(flat) : [v];
  // max |kernel − reference|: equal values (−∞ and −∞ too) count 0, −∞ against a number ∞
  function maxDiff(ref, mine) {
    const a = flat(ref), b = flat(mine);
    return a.reduce((m, x, n) => Math.max(m, x === b[n] ? 0 : (x === null || b[n] === null) ? Infinity
      : Math.abs(x - b[n])), 0);
  }
  const shown = x => x === Infinity ? "∞" : x.toPrecision(3);

  function draw(body, c) {
    body.replaceChildren();
    if (!c.kernel) return;
    const table = el("table", {className: "metrics kernel-terms", id: "kernel-terms"},
      el("caption", {textContent: "Reference | kernel | max |difference|, per query row"}),
      el("tr", {}, ...["term", "row", "reference", "kernel", "difference"].map(h => el("th", {textContent: h}))));
    for (const term of c.kernel.terms) {
      const ref = rows(term.reference), mine = rows(term.kernel);
      ref.forEach((r, n) => table.append(el("tr", {dataset: {term: term.name, row: view.rowStart + n}},
        el("td", {textContent: n === 0 ? term.name : ""}),
        el("td", {className: "value", textContent: String(view.rowStart + n)}),
        el("td", {className: "reference", textContent: rows(r).map(digits).join(" ")}),
        el("td", {className: "kernel", textContent: rows(mine[n]).map(digits).join(" ")}),
        el("td", {className: "difference value", textContent: shown(maxDiff(r, mine[n]))}))));
    }
    body.append(el("p", {className: "meta", textContent: `${view.source}, tiles ${view.blockM} × ${view.blockN}. ` +
      view.tiles}), el("div", {className: "kernel-scroll"}, table),
      el("p", {className: "meta kernel-note", textContent: view.note}));
  }

  Page.addForwardPanel("kernel", "Kernel beside reference", draw);
})();
