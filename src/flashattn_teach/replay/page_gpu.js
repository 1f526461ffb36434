// The GPU schedule view (trace/gpu_schedule.py): the forward kernel's grid of programs (query block i x head h)
// launched in index order and longest first, side by side on a pretend GPU, stepping through the times at
// which a program starts or ends. A program waits, runs (start <= t < end) or is done (end <= t).
(() => {
  const {el, views} = Page;
  const d = views.gpu;
  if (!d) return;
  const S = d.states, SHAPE = d.shapes, SVG = "http://www.w3.org/2000/svg", UNIT = 24, ROW = 22;
  const num = x => Number.isInteger(x) ? String(x) : x.toFixed(2);
  const pct = x => (100 * x).toFixed(1) + "%";
  const state = (p, t) => p.end <= t ? S.DONE : p.start <= t ? S.RUNNING : S.WAITING;
  const svg = (tag, attrs, text) => {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // The T_r x H grid of one launch: a cell per program, its (i, h), work and slot.
  function grid(la) {
    const table = el("table", {className: "gpu-grid"});
    const head = table.createTHead().insertRow();
    head.append(el("th", {textContent: "i \\ h"}), ...Array.from({length: d.shape.heads}, (_, h) => el("th", {textContent: h})));
    const body = table.createTBody(), cells = [];
    for (let i = 0; i < d.shape.T_r; i++) {
      const tr = body.insertRow();
      tr.append(el("th", {textContent: i}));
      for (let h = 0; h < d.shape.heads; h++) tr.insertCell();
    }
    for (const p of la.programs) {
      const cell = body.rows[p.i].cells[p.head + 1];
      cell.className = "gpu-program"; cell.dataset.pid = p.pid;
      cell.title = `program ${p.pid}: query block ${p.i}, head ${p.head}, ${num(p.work)} tiles, slot ${p.slot}, ` +
        `t = ${num(p.start)} to ${num(p.end)}, wave ${p.wave}`;
      cell.append(el("b", {textContent: `#${p.pid}`}), el("span", {textContent: ` ${num(p.work)}t`}));
      cells[p.pid] = cell;
    }
    return {table, cells};
  }

  // One row per slot: each program a bar from its start to its end; a line marks the time shown.
  function timeline(la, end) {
    const pad = 46, width = pad + end * UNIT + 8, height = d.gpu.slots * ROW + 18;
    const root = svg("svg", {class: "gpu-timeline", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", "aria-label": `slots over time, ${la.order}`});
    for (let s = 0; s < d.gpu.slots; s++) root.append(svg("text", {x: 2, y: s * ROW + 15}, `slot ${s}`));
    for (let t = 0; t <= end; t++)
      if (t % Math.max(1, Math.ceil(end / 16)) === 0) root.append(svg("text", {x: pad + t * UNIT, y: height - 2, class: "tick"}, t));
    const bars = la.programs.map(p => {
      const g = svg("g", {"data-pid": p.pid});
      g.append(svg("rect", {x: pad + p.start * UNIT, y: p.slot * ROW + 2, width: Math.max(1, p.work * UNIT), height: ROW - 4}),
        svg("text", {x: pad + p.start * UNIT + 3, y: p.slot * ROW + 15}, `${p.i},${p.head}`));
      root.append(g);
      return g;
    });
    const now = svg("line", {y1: 0, y2: d.gpu.slots * ROW, class: "now"});
    root.append(now);
    return {root, bars, now: t => { now.setAttribute("x1", pad + t * UNIT); now.setAttribute("x2", pad + t * UNIT); }};
  }

  function h100Table() {
    const table = el("table", {className: "gpu-h100"});
    table.createTHead().insertRow().append(...["grid", "mask", "order", "waves", "makespan", "idle"]
      .map(t => el("th", {textContent: t})));
    const body = table.createTBody();
    for (const r of d.h100.rows) {
      const tr = body.insertRow();
      tr.dataset.shape = r.shape; tr.dataset.order = r.order; tr.dataset.causal = r.causal;
      const grid = r.shape === SHAPE.REPLAY ? `${d.shape.T_r} x ${d.shape.heads}` : r.shape;
      for (const t of [grid, r.causal ? "causal" : "none", r.order, r.waves.toFixed(2), num(r.makespan), pct(r.idle)])
        tr.insertCell().textContent = t;
    }
    return table;
  }

  Page.addView("gpu", "GPU schedule", section => {
    const end = Math.max(...d.launches.map(la => la.makespan));
    const masks = d.shape.masks.length ? d.shape.masks.join(", ") : "no mask";
    section.append(el("p", {className: "meta", textContent:
      `The forward kernel's grid: one program per query block i and head h, ${d.shape.T_r} x ${d.shape.heads} = ` +
      `${d.shape.T_r * d.shape.heads} programs (${masks}); program (i, h) computes the ${d.work.map(num).join(", ")} ` +
      `tiles its query block visits. A pretend GPU of ${d.gpu.sms} SM${d.gpu.sms > 1 ? "s" : ""} x ` +
      `${d.gpu.programsPerSm} program = ${d.gpu.slots} slot${d.gpu.slots > 1 ? "s" : ""}: the block scheduler starts ` +
      `the programs in program-id order (#), each on the slot that frees first. Times in tile-times; ` +
      "a bar on a slot is program (i, h)."}));
    const clock = el("p", {id: "gpu-time", className: "gpu-clock"});
    const panels = d.launches.map(la => {
      const g = grid(la), tl = timeline(la, end), status = el("p", {className: "meta gpu-status"});
      const box = el("div", {className: "gpu-launch", dataset: {order: la.order}},
        el("h2", {textContent: la.title}),
        el("p", {className: "meta", textContent: `makespan ${num(la.makespan)}, ideal ${num(la.ideal)} (total / slots), ` +
          `idle ${pct(la.idle)}, ${num(la.waves)} programs per slot`}),
        g.table, el("div", {className: "gpu-scroll"}, tl.root), status);
      return {la, box, cells: g.cells, bars: tl.bars, now: tl.now, status};
    });
    const legend = el("div", {className: "legend"}, ...[S.WAITING, S.RUNNING, S.DONE].map(s => el("span", {}, el("i", {className: `gpu-${s}`}), s)));
    const stepper = Page.stepper(section, d.times.length, "Time", k => {
      const t = d.times[k];
      clock.textContent = `t = ${num(t)}`;
      section.dataset.time = t;
      for (const p of panels) {
        let running = 0, done = 0;
        for (const prog of p.la.programs) {
          const s = state(prog, t);
          p.cells[prog.pid].dataset.state = s; p.cells[prog.pid].className = `gpu-program gpu-${s}`;
          p.bars[prog.pid].setAttribute("class", `gpu-${s}`);
          running += s === S.RUNNING; done += s === S.DONE;
        }
        p.now(t);
        p.status.textContent = `${running} running, ${done} of ${p.la.programs.length} done`;
      }
    }, {prev: "gpu-prev", next: "gpu-next", counter: "gpu-counter"});
    section.append(clock, legend, el("div", {className: "gpu-launches"}, ...panels.map(p => p.box)),
      el("h2", {textContent: `On an H100 (${d.h100.sms} SMs, one program each)`}),
      el("p", {className: "meta", textContent: `The replay's grid (${d.shape.T_r} x ${d.shape.heads}, in tile-times) is ` +
        "a fraction of one wave there: every program starts at t = 0 and the order cannot matter. At the " +
        `benchmark's causal shape (${d.h100.benchmark}), ` +
        `${d.h100.rows.find(r => r.shape === SHAPE.BENCHMARK).waves.toFixed(0)} waves, longest first fills the tail ` +
        "(work in loop iterations with each program's loads and stores, as flashattn-teach kernels --schedule " +
        "prices them)."}), el("div", {className: "gpu-scroll"}, h100Table()));
    stepper.go(0);
    return stepper;
  });
})();
