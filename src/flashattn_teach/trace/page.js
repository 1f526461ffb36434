// The tile replay page (flashattn_teach/trace/html.py): draws the embedded experiment, one case at a time.
const data = JSON.parse(document.getElementById("replay-data").textContent);
// The Python enums TileState and TileKind, as {NAME: value}, so no state is spelt here a second time.
const {TileState: STATE, TileKind: KIND} = JSON.parse(document.getElementById("replay-enums").textContent);
const KIND_NAME = Object.fromEntries(Object.entries(KIND).map(([name, value]) => [value, name]));
const cases = data.cases, ext = data.replay || null;
const SVG = "http://www.w3.org/2000/svg", CELL = 26;
let index = 0;

// One scale for every bar of every case, so bars keep their meaning while stepping.
let scale = 0;
for (const c of cases)
  for (const v of c.vectors) for (const x of v.values) if (x !== null) scale = Math.max(scale, Math.abs(x));
scale = scale || 1;

const fmt = x => x === null ? "−∞" : Number(x).toPrecision(4);

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

function drawGrid(c) {
  const s = c.schedule, svg = document.getElementById("grid"), pad = 22;
  svg.setAttribute("width", pad + s.columns * CELL + 2);
  svg.setAttribute("height", pad + s.rows * CELL + 2);
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

function line(svg, x1, y1, x2, y2) {
  const e = document.createElementNS(SVG, "line");
  Object.entries({x1, y1, x2, y2, stroke: "#222", "stroke-width": 2}).forEach(([k, v]) => e.setAttribute(k, v));
  svg.appendChild(e);
}

function drawVectors(c) {
  const root = document.getElementById("vectors");
  root.replaceChildren();
  c.vectors.forEach((v, vi) => {
    const box = document.createElement("div"); box.className = "vector"; box.dataset.vector = vi;
    const label = document.createElement("div"); label.className = "label"; label.textContent = v.label;
    box.appendChild(label);
    v.values.forEach((x, k) => {
      const row = document.createElement("div"); row.className = "bar-row";
      const track = document.createElement("div"); track.className = "track";
      const axis = document.createElement("div"); axis.className = "axis"; track.appendChild(axis);
      if (x !== null) {
        const bar = document.createElement("div"), w = 50 * Math.abs(x) / scale;
        bar.className = "bar" + (x < 0 ? " neg" : "");
        bar.style.left = (x < 0 ? 50 - w : 50) + "%"; bar.style.width = w + "%";
        track.appendChild(bar);
      }
      const value = document.createElement("span"); value.className = "value"; value.dataset.index = k;
      value.textContent = fmt(x);
      row.append(track, value); box.appendChild(row);
    });
    root.appendChild(box);
  });
}

// With an attention sink: each row's share so far, exp(sink − m_i) / l_i, on a 0–1 scale, and its final
// share exp(sink − lse_i); the keys hold the rest.
function drawSink(c) {
  const root = document.getElementById("sink");
  root.hidden = !data.sink;
  root.replaceChildren();
  if (!data.sink) return;
  const box = document.createElement("div"); box.className = "sink-share";
  const label = document.createElement("div"); label.className = "label";
  label.textContent = `Sink share so far · exp(sink − m_i) / l_i · sink = ${fmt(data.sink.value)}`;
  box.appendChild(label);
  c.sinkShare.forEach((x, r) => {
    const row = document.createElement("div"); row.className = "bar-row"; row.dataset.row = data.sink.rowStart + r;
    const name = document.createElement("span"); name.className = "row-label";
    name.textContent = `row ${data.sink.rowStart + r}`;
    const track = document.createElement("div"); track.className = "track share";
    const bar = document.createElement("div"); bar.className = "bar sink"; bar.style.width = 100 * x + "%";
    track.appendChild(bar);
    const value = document.createElement("span"); value.className = "value share"; value.textContent = fmt(x);
    const final = document.createElement("span"); final.className = "value final";
    final.textContent = `final exp(sink − lse_i): ${fmt(data.sink.share[r])}`;
    row.append(name, track, value, final); box.appendChild(row);
  });
  root.appendChild(box);
}

function drawMetrics(c) {
  const table = document.getElementById("metrics");
  table.replaceChildren();
  c.metrics.forEach((m, mi) => {
    const tr = table.insertRow(); tr.dataset.metric = mi;
    tr.insertCell().textContent = m.label;
    const td = tr.insertCell(); td.className = "value";
    td.textContent = Number.isInteger(m.value) ? String(m.value) : fmt(m.value);
  });
}

function show(k) {
  if (!cases.length) { document.getElementById("counter").textContent = "No tile updates"; return; }
  index = Math.max(0, Math.min(cases.length - 1, k));
  const c = cases[index];
  document.getElementById("counter").textContent = `${data.controlLabel} ${index + 1} of ${cases.length}`;
  document.getElementById("case-label").textContent = c.label;
  document.getElementById("position").textContent = ext && c.tiles
    ? `tile (i=${c.tiles.i}, j=${c.tiles.j}), ${KIND_NAME[c.tiles.kind]}${c.tiles.kind === KIND.PARTIAL ? " (masked)" : ""}, ` +
      `step ${c.tiles.position} of ${ext.scheduleLength} in the ${ext.order} schedule` : "";
  document.getElementById("prev").disabled = index === 0;
  document.getElementById("next").disabled = index === cases.length - 1;
  drawGrid(c); drawVectors(c); drawSink(c); drawMetrics(c);
  document.body.dataset.case = c.id;
}

document.getElementById("title").textContent = data.title;
document.getElementById("meta").textContent = ext
  ? `${ext.order} order · query block ${ext.queryBlock} · BLOCK_M=${ext.blockM}, BLOCK_N=${ext.blockN}` +
    (ext.causal ? ` · causal (${ext.causalAlign})` : "") +
    (ext.variants.includes("window") ? ` · window (${ext.window[0]}, ${ext.window[1]})` : "") +
    ext.variants.filter(v => v !== "window").map(v => ` · ${v}`).join("") +
    (data.sink ? ` · sink ${fmt(data.sink.value)}` : "") : "";
document.getElementById("legend").innerHTML =
  Object.values(STATE).map(s => `<span><i class="${s}"></i>${s}</span>`).join("");
document.getElementById("prev").addEventListener("click", () => show(index - 1));
document.getElementById("next").addEventListener("click", () => show(index + 1));
document.addEventListener("keydown", e => {
  if (e.key === "ArrowRight") show(index + 1);
  if (e.key === "ArrowLeft") show(index - 1);
});
show(0);
