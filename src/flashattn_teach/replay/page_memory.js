// The memory panel of the forward view (memory.py): at each tile update, what the program holds on chip and the
// HBM bytes the whole schedule has moved so far, per tensor, next to what standard attention (Alg. 0, S and P
// through HBM) moves in total. Every bar shares one scale, the dense path's total bytes.
(() => {
  const {views, el} = Page;
  const memory = views.memory;
  if (!memory) return;  // the Python side built nothing for this replay
  const B = n => `${n} B`;
  const scale = memory.dense.read + memory.dense.written || 1;
  // The tiled order's tensors first (Q, K, V, O, then lse or l, m), then the dense path's own (S, P).
  const tensors = [...new Set([...Object.keys(memory.total.reads), ...Object.keys(memory.total.writes),
    ...Object.keys(memory.dense.reads), ...Object.keys(memory.dense.writes)])];

  function cell(value, tensor, kind) {
    const bar = el("div", {className: `mem-bar ${kind}`});
    bar.style.width = `${Math.min(100, 100 * value / scale)}%`;
    return el("td", {}, el("div", {className: "value", dataset: {tensor, kind}, textContent: B(value)}),
      el("div", {className: "mem-track"}, bar));
  }

  function onChip(step) {
    const table = el("table", {className: "metrics mem-chip", id: "memory-chip"},
      el("caption", {textContent: "On chip while this tile is folded in"}));
    for (const b of step.onChip)
      table.append(el("tr", {dataset: {buffer: b.name}}, el("td", {textContent: b.name}),
        el("td", {textContent: b.shape.join(" × ")}), el("td", {className: "value", textContent: B(b.bytes)})));
    table.append(el("tr", {className: "total"}, el("td", {textContent: "total"}), el("td"),
      el("td", {className: "value", id: "memory-chip-total", textContent: B(step.onChipBytes)})));
    return table;
  }

  function hbm(step) {
    const head = el("tr", {}, ...["tensor", "read so far", "written so far", "dense path: read", "dense: written"]
      .map(t => el("th", {textContent: t})));
    const table = el("table", {className: "mem-hbm", id: "memory-hbm"},
      el("caption", {textContent: `HBM traffic of the ${memory.order} schedule so far (bars: share of the dense ` +
        `path's ${B(scale)})`}), head);
    const row = (name, r, w, dr, dw, cls = "") => table.append(el("tr", {className: cls, dataset: {tensor: name}},
      el("th", {textContent: name}), cell(r, name, "read"), cell(w, name, "written"),
      cell(dr, name, "dense-read"), cell(dw, name, "dense-written")));
    for (const t of tensors)
      row(t, step.hbm.reads[t] || 0, step.hbm.writes[t] || 0, memory.dense.reads[t] || 0, memory.dense.writes[t] || 0);
    row("all", step.hbm.read, step.hbm.written, memory.dense.read, memory.dense.written, "total");
    return table;
  }

  Page.addForwardPanel("memory", "Memory: on chip, and HBM bytes so far", (body, c, k) => {
    const step = memory.steps[k];
    body.replaceChildren();
    if (!step) return;
    const total = memory.total.read + memory.total.written;
    const agrees = memory.closedForm === null ? "iomodel has no closed form for this mask or shape"
      : `iomodel's closed form for the ${memory.order} order gives ` +
        `${B(memory.closedForm.read + memory.closedForm.written)}`;
    body.append(
      el("p", {className: "meta", id: "memory-summary", textContent:
        `Schedule position ${step.position} of ${memory.scheduleLength} · matrices ${memory.elemBytes} B per ` +
        `element, statistics ${memory.statBytes} B · so far ${B(step.hbm.read + step.hbm.written)} of the ` +
        `schedule's ${B(total)} (${agrees}); the dense path moves ${B(scale)}`}),
      el("div", {className: "mem-layout"}, onChip(step), hbm(step)));
  });
})();
