// The kernel's numbers beside the reference's (source="triton"): one renderer, Page.kernelPanel, for every view
// that has them: the forward view's panel "Kernel beside reference" (here, from kernel_view.py's build_view and
// the case's "kernel"), each dK/dV and dQ step of the Backward view (page_backward.js, kernel_view_backward.py)
// and each split update and merge of the decode page (page_decode.js, kernel_view_decode.py). Per traced term and
// row: the reference's numbers, the kernel's and the largest difference between them; eight significant digits,
// since what differs is in the last ones. The numbers are the JSON's; the note says what explains the differences.
(() => {
  const {el} = Page;
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

  // body ← the meta lines, the table of kernel.terms ({name, reference, kernel}: a vector is one number a row, a
  // matrix one row a row) and the note. id: the table's; rowOf(name, n): the label of the term's n-th row.
  function kernelPanel(body, kernel, {id, meta, note, rowOf}) {
    const table = el("table", {className: "metrics kernel-terms", id},
      el("caption", {textContent: "Reference | kernel | max |difference|, per row"}),
      el("tr", {}, ...["term", "row", "reference", "kernel", "difference"].map(h => el("th", {textContent: h}))));
    for (const term of kernel.terms) {
      const ref = rows(term.reference), mine = rows(term.kernel);
      ref.forEach((r, n) => table.append(el("tr", {dataset: {term: term.name, row: rowOf(term.name, n)}},
        el("td", {textContent: n === 0 ? term.name : ""}),
        el("td", {className: "value", textContent: String(rowOf(term.name, n))}),
        el("td", {className: "reference", textContent: rows(r).map(digits).join(" ")}),
        el("td", {className: "kernel", textContent: rows(mine[n]).map(digits).join(" ")}),
        el("td", {className: "difference value", textContent: shown(maxDiff(r, mine[n]))}))));
    }
    body.replaceChildren(...rows(meta).map(text => el("p", {className: "meta", textContent: text})),
      el("div", {className: "kernel-scroll"}, table), el("p", {className: "meta kernel-note", textContent: note}));
  }
  Page.kernelPanel = kernelPanel;

  const view = Page.views.kernel;  // {source, blockM, blockN, tiles, note, rowStart}; absent: no forward kernel ran
  if (!view) return;
  Page.addForwardPanel("kernel", "Kernel beside reference", (body, c) => {
    if (!c.kernel) { body.replaceChildren(); return; }
    kernelPanel(body, c.kernel, {id: "kernel-terms", note: view.note, rowOf: (_, n) => view.rowStart + n,
      meta: `${view.source}, tiles ${view.blockM} × ${view.blockN}. ${view.tiles}`});
  });
})();
