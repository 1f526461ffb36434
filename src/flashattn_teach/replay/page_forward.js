// The forward view: one query block's tile updates, the schedule grid, the vectors on one shared scale, the
// sink's share and the metrics, then the forward panels (equations, memory, ...) at the same update.
(() => {
  const {data, enums, fmt, el} = Page;
  const {TileState: STATE, TileKind: KIND} = enums;
  const KIND_NAME = Object.fromEntries(Object.entries(KIND).map(([name, value]) => [value, name]));
  const cases = data.cases, ext = data.replay || null;
  const SVG = "http://www.w3.org/2000/svg", CELL = 26;

  // One scale for every bar of every case, so bars keep their meaning while stepping.
  let scale = 0;
  for (const c of cases)
    for (const v of c.vectors) for (const x of v.values) if (x !== null) scale = Math.max(scale, Math.abs(x));
  scale = scale || 1;

  function tileState(c, r, col) {
    const s = c.schedule;
    const inRows = r >= s.rowStart && r < s.rowStart + s.rowCount;
    if (inRows && col >= s.columnStart && col < s.columnStart + s.columnCount) return STATE.CURRENT;
    if (!ext) return inRows && col < s.completedColumns ? STATE.ACCUMULATED : STATE.PENDING;
    const tile = [Math.floor(r / ext.blockM), Math.floor(col / ext.blockN)];
    const has = list => list.some(t => t[0] === tile[0] && t[1] === tile[1]);
    if (has(ext.skipped)) return STATE.SKIPPED;
    if (has(c.tiles.done)) return tile[0] === c.tiles.i ? STATE.ACCUMULATED : STATE.DONE;
    return STATE.PENDING;
  }

  function line(svg, x1, y1, x2, y2) {
    const e = document.createElementNS(SVG, "line");
    Object.entries({x1, y1, x2, y2, stroke: "#222", "stroke-width": 2}).forEach(([k, v]) => e.setAttribute(k, v));
    svg.appendChild(e);
  }

  function drawGrid(svg, c) {
    const s = c.schedule, pad = 22;
    svg.setAttribute("width", pad + s.columns * CELL + 2);
    svg.setAttribute("height", pad + s.rows * CELL + 2);
    svg.setAttribute("viewBox", `0 0 ${pad + s.columns * CELL + 2} ${pad + s.rows * CELL + 2}`);
    svg.replaceChildren();
    const text = (x, y, t) => { const e = document.createElementNS(SVG, "text"); e.setAttribute("x", x);
      e.setAttribute("y", y); e.setAttribute("font-size", 10); e.setAttribute("text-anchor", "middle");
      e.textContent = t; svg.appendChild(e); };
    for (let col = 0; col < s.columns; col++) text(pad + col * CELL + CELL / 2, 14, col);
    for (let r = 0; r < s.rows; r++) {
      text(10, pad + r * CELL + CELL / 2 + 4, r);
      for (let col = 0; col < s.columns; col++) {
        const e = document.createElementNS(SVG, "rect"), state = tileState(c, r, col);
        // Masked cells of a partial tile are drawn pale; a skipped tile is masked everywhere and drawn grey.
        const masked = ext && ext.visible && state !== STATE.SKIPPED && ext.visible[r][col] === "0";
        e.setAttribute("x", pad + col * CELL); e.setAttribute("y", pad + r * CELL);
        e.setAttribute("width", CELL); e.setAttribute("height", CELL);
        e.setAttribute("stroke", "#888"); e.setAttribute("class", state + (masked ? " masked" : ""));
        e.dataset.row = r; e.dataset.column = col; e.dataset.state = state;
        svg.appendChild(e);
        if (state === STATE.SKIPPED) text(pad + col * CELL + CELL / 2, pad + r * CELL + CELL / 2 + 4, "×");
      }
    }
    if (ext) {  // tile boundaries
      const w = s.columns * CELL, h = s.rows * CELL;
      for (let r = 0; r <= s.rows; r += ext.blockM) line(svg, pad, pad + r * CELL, pad + w, pad + r * CELL);
      for (let col = 0; col <= s.columns; col += ext.blockN) line(svg, pad + col * CELL, pad, pad + col * CELL, pad + h);
      line(svg, pad, pad + h, pad + w, pad + h); line(svg, pad + w, pad, pad + w, pad + h);
    }
  }

  function drawVectors(root, c) {
    root.replaceChildren();
    c.vectors.forEach((v, vi) => {
      const box = el("div", {className: "vector", dataset: {vector: vi}}, el("div", {className: "label", textContent: v.label}));
      v.values.forEach((x, k) => {
        const track = el("div", {className: "track"}, el("div", {className: "axis"}));
        if (x !== null) {
          const w = 50 * Math.abs(x) / scale, bar = el("div", {className: "bar" + (x < 0 ? " neg" : "")});
          bar.style.left = (x < 0 ? 50 - w : 50) + "%"; bar.style.width = w + "%";
          track.appendChild(bar);
        }
        box.appendChild(el("div", {className: "bar-row"}, track,
          el("span", {className: "value", dataset: {index: k}, textContent: fmt(x)})));
      });
      root.appendChild(box);
    });
  }

  // With an attention sink: each row's share so far, exp(sink − m_i) / l_i, on a 0–1 scale, and its final
  // share exp(sink − lse_i); the keys hold the rest.
  function drawSink(root, c) {
    root.hidden = !data.sink;
    root.replaceChildren();
    if (!data.sink) return;
    const box = el("div", {className: "sink-share"}, el("div", {className: "label",
      textContent: `Sink share so far · exp(sink − m_i) / l_i · sink = ${fmt(data.sink.value)}`}));
    c.sinkShare.forEach((x, r) => {
      const bar = el("div", {className: "bar sink"}); bar.style.width = 100 * x + "%";
      box.appendChild(el("div", {className: "bar-row", dataset: {row: data.sink.rowStart + r}},
        el("span", {className: "row-label", textContent: `row ${data.sink.rowStart + r}`}),
        el("div", {className: "track share"}, bar),
        el("span", {className: "value share", textContent: fmt(x)}),
        el("span", {className: "value final", textContent: `final exp(sink − lse_i): ${fmt(data.sink.share[r])}`})));
    });
    root.appendChild(box);
  }

  function drawMetrics(table, c) {
    table.replaceChildren();
    c.metrics.forEach((m, mi) => {
      const tr = table.insertRow(); tr.dataset.metric = mi;
      tr.insertCell().textContent = m.label;
      const td = tr.insertCell(); td.className = "value";
      td.textContent = Number.isInteger(m.value) ? String(m.value) : fmt(m.value);
    });
  }

  document.getElementById("title").textContent = data.title;
  document.getElementById("meta").textContent = ext
    ? `${ext.order} order · query block ${ext.queryBlock} · BLOCK_M=${ext.blockM}, BLOCK_N=${ext.blockN}` +
      ext.labels.map(label => ` · ${label}`).join("") : "";  // Replay.labels(), as the table's and the PNG's

  Page.addView("forward", "Forward", section => {
    const label = el("h2", {id: "case-label"}), position = el("p", {className: "meta", id: "position"});
    const grid = el("svg", {id: "grid", attrs: {role: "img", "aria-label": "schedule grid"}});
    const legend = el("div", {className: "legend", id: "legend"});
    const vectors = el("div", {id: "vectors"}), sink = el("div", {id: "sink", hidden: true});
    const metrics = el("table", {className: "metrics", id: "metrics"});
    const panels = Page.panels.map(p => {
      const body = el("div", {className: "panel-body"});
      return {...p, box: el("div", {className: "panel", id: p.id}, el("h2", {textContent: p.title}), body), body};
    });
    legend.append(...Object.values(STATE).map(s => el("span", {}, el("i", {className: s}), s)));
    const s = Page.stepper(section, cases.length, data.controlLabel, k => {
      const c = cases[k];
      label.textContent = c.label;
      position.textContent = ext && c.tiles
        ? `tile (i=${c.tiles.i}, j=${c.tiles.j}), ${KIND_NAME[c.tiles.kind]}${c.tiles.kind === KIND.PARTIAL ? " (masked)" : ""}, ` +
          `step ${c.tiles.position} of ${ext.scheduleLength} in the ${ext.order} schedule` : "";
      drawGrid(grid, c); drawVectors(vectors, c); drawSink(sink, c); drawMetrics(metrics, c);
      for (const p of panels) p.draw(p.body, c, k);
      document.body.dataset.case = c.id;
    }, {prev: "prev", next: "next", counter: "counter"});
    section.append(label, position, el("div", {className: "layout"}, el("div", {}, grid, legend), vectors, sink),
      el("h2", {textContent: "Metrics"}), metrics, ...panels.map(p => p.box));
    s.go(0);
    return s;
  });
})();
