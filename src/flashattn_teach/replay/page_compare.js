// The side-by-side view (compare.py): the query-major order, the key-major order and dense attention on the
// same inputs. Step t shows each order after its t-th tile (schedule position t, the same work done); every
// row's m_i, l_i and acc / l_i are the latest update of its query block up to t; dense is the fixed target.
(() => {
  const {enums, fmt, el} = Page;
  const STATE = enums.TileState, CELL = 28, PAD = 18;

  // The state of every query row after updates[0..t] of one order: {m, l, O, block, done} per row.
  function rowsAt(payload, updates, t) {
    const rows = Array.from({length: payload.N_q}, () => ({m: payload.initial.m, l: payload.initial.l, O: null}));
    for (let s = 0; s <= t; s++) {
      const u = updates[s];
      for (let r = u.rows[0]; r < u.rows[1]; r++) {
        const k = r - u.rows[0];
        rows[r] = {m: u.m[k], l: u.l[k], O: u.O[k]};
      }
    }
    return rows;
  }

  function tileState(payload, updates, t, i, j) {
    const now = updates[t];
    if (now.i === i && now.j === j) return STATE.CURRENT;
    if (payload.skipped.some(x => x[0] === i && x[1] === j)) return STATE.SKIPPED;
    for (let s = 0; s < t; s++)
      if (updates[s].i === i && updates[s].j === j) return i === now.i ? STATE.ACCUMULATED : STATE.DONE;
    return STATE.PENDING;
  }

  function drawGrid(svg, payload, updates, t) {
    const w = PAD + payload.T_c * CELL + 2, h = PAD + payload.T_r * CELL + 2;
    svg.replaceChildren();
    Object.entries({width: w, height: h, viewBox: `0 0 ${w} ${h}`}).forEach(([k, v]) => svg.setAttribute(k, v));
    const text = (x, y, t) => svg.appendChild(el("text", {svg: true, textContent: t,
      attrs: {x, y, "font-size": 10, "text-anchor": "middle"}}));
    for (let j = 0; j < payload.T_c; j++) text(PAD + j * CELL + CELL / 2, 12, `j=${j}`);
    for (let i = 0; i < payload.T_r; i++) {
      text(8, PAD + i * CELL + CELL / 2 + 4, i);
      for (let j = 0; j < payload.T_c; j++) {
        const state = tileState(payload, updates, t, i, j);
        svg.appendChild(el("rect", {svg: true, dataset: {i, j, state}, attrs: {class: state, stroke: "#888",
          x: PAD + j * CELL, y: PAD + i * CELL, width: CELL, height: CELL}}));
        if (state === STATE.SKIPPED) text(PAD + j * CELL + CELL / 2, PAD + i * CELL + CELL / 2 + 4, "×");
      }
    }
  }

  // One table of rows: row, m, l, the output row (partial or final) and its distance to dense.
  function drawRows(table, payload, rows, current) {
    const dv = payload.dense.O[0] ? payload.dense.O[0].length : 0;
    table.replaceChildren();
    const head = table.createTHead().insertRow();
    for (const h of ["row", "m_i", "l_i", ...Array.from({length: dv}, (_, d) => `O[${d}]`), "max |O − dense|"])
      head.appendChild(el("th", {scope: "col", textContent: h}));
    const body = table.createTBody();
    rows.forEach((row, r) => {
      const tr = body.insertRow();
      tr.dataset.row = r;
      if (current && r >= current[0] && r < current[1]) tr.className = "in-tile";
      tr.insertCell().textContent = r;
      tr.insertCell().textContent = fmt(row.m);
      tr.insertCell().textContent = fmt(row.l);
      for (let d = 0; d < dv; d++) tr.insertCell().textContent = row.O ? fmt(row.O[d]) : "—";
      const gap = row.O ? Math.max(...row.O.map((x, d) => Math.abs(x - payload.dense.O[r][d]))) : null;
      const cell = tr.insertCell();
      cell.textContent = gap === null ? "—" : Number(gap).toExponential(1);
      cell.className = "gap";
      for (const c of tr.cells) c.classList.add("num");
    });
  }

  Page.addView("compare", "Side by side", (section, payload) => {
    section.append(el("p", {className: "caption", textContent:
      "Both orders compute the same tiles, each once, so step t shows each order after its t-th tile: the same " +
      "work done. Query-major (FlashAttention-2) finishes one query block's row of tiles before starting the " +
      "next, so its rows become final one block at a time; key-major (FlashAttention's Alg. 1) sweeps one key " +
      "block down every query block, so every row stays partial until the last key block. Each table gives " +
      "every query row's running max m_i, denominator l_i and output so far acc / l_i (the rows of the tile " +
      "just folded in are highlighted; — marks a row not yet started). Both end at the dense result, " +
      "the fixed target, which sees all keys at once: m = rowmax(S), l = rowsum(exp(S − m)), O = exp(S − m) V / l."}));
    section.append(el("div", {className: "legend"},
      ...Object.values(STATE).map(state => el("span", {}, el("i", {className: state}), state))));
    const columns = payload.orders.map(o => {
      const meta = el("p", {className: "meta"});
      const grid = el("svg", {svg: true, attrs: {role: "img", "aria-label": `${o.title}: tile grid`}});
      const table = el("table", {className: "compare-rows"});
      const box = el("div", {className: "compare-column", dataset: {order: o.order}},
        el("h2", {textContent: o.title}), meta, el("div", {className: "scroll"}, grid),
        el("div", {className: "scroll"}, table));
      return {o, meta, grid, table, box};
    });
    const dense = el("table", {className: "compare-rows"});
    const denseRows = payload.dense.m.map((m, r) => ({m, l: payload.dense.l[r], O: payload.dense.O[r]}));
    drawRows(dense, payload, denseRows, null);
    const lse = el("p", {className: "meta", textContent: "lse = m + log l: " + payload.dense.lse.map(fmt).join(", ")});
    const denseBox = el("div", {className: "compare-column", dataset: {order: "dense"}},
      el("h2", {textContent: "Dense attention (the target)"}),
      el("p", {className: "meta", textContent: `every row over all ${payload.N_k} keys at once`}),
      el("div", {className: "scroll"}, dense), lse);
    const s = Page.stepper(section, payload.length, "Step", t => {
      for (const c of columns) {
        const u = c.o.updates[t];
        c.meta.textContent = `tile (i=${u.i}, j=${u.j}): rows ${u.rows[0]}–${u.rows[1] - 1}`;
        drawGrid(c.grid, payload, c.o.updates, t);
        drawRows(c.table, payload, rowsAt(payload, c.o.updates, t), u.rows);
      }
      section.dataset.step = t;
    }, {prev: "compare-prev", next: "compare-next", counter: "compare-counter"});
    section.append(el("div", {className: "compare"}, ...columns.map(c => c.box), denseBox));
    s.go(0);
    return s;
  });
})();
