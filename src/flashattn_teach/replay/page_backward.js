// The backward view (manifest.py: to_backward_json): FlashAttention-2 Alg. 2 one step at a time — the preprocess
// (delta), every dK/dV step, every dQ step, then the gradients against float64 autograd. Each step shows its
// tile on the (T_r, T_c) grid, the tile's P_ij, dP_ij, dS_ij, the accumulators after it, and its equations
// with their numbers. With source="triton" each dK/dV and dQ step also shows the kernels' terms beside the
// reference's (d.kernel, step.kernel: kernel_view_backward.py), drawn by page_kernel.js's Page.kernelPanel.
(() => {
  const {enums, fmt, el} = Page;
  const STATE = enums.TileState;
  const SVG = "http://www.w3.org/2000/svg", CELL = 30;

  Page.addView("backward", "Backward", (section, d) => {
    const PASS = d.stepKinds, KIND_NAME = Object.fromEntries(Object.entries(d.tileKinds).map(([n, v]) => [v, n]));
    const skipped = new Set(d.skipped.map(([i, j]) => `${i},${j}`));
    const total = d.steps.length + 1;  // the steps, then the result
    const passTitle = {[PASS.DKDV]: "dK/dV pass", [PASS.DQ]: "dQ pass"};

    const label = el("h2", {id: "bwd-label"}), position = el("p", {className: "meta", id: "bwd-position"});
    const grid = el("svg", {id: "bwd-grid", attrs: {role: "img", "aria-label": "backward tile grid"}});
    const legend = el("div", {className: "legend"},
      ...Object.values(STATE).map(s => el("span", {}, el("i", {className: s}), s)));
    const matrices = el("div", {className: "bwd-matrices", id: "bwd-matrices"});
    const equations = el("ol", {className: "bwd-equations", id: "bwd-equations"});
    const equationsTitle = el("h2", {textContent: "Equations (FA2 Alg. 2), with the numbers"});
    const result = el("div", {id: "bwd-result"});
    const K = d.kernel, kernelBody = el("div", {className: "panel-body"});  // K: absent for the reference alone
    const kernel = K ? el("div", {className: "panel", id: "bwd-kernel"},
      el("h2", {textContent: "Kernels beside reference"}), kernelBody) : null;

    // Tile (i, j) at step n: the current tile, tiles of earlier steps of the same pass (ACCUMULATED when they
    // fed the same accumulator: the same j for dK/dV, the same i for dQ), SKIP tiles, the rest pending.
    function tileState(n, i, j) {
      if (skipped.has(`${i},${j}`)) return STATE.SKIPPED;
      if (n >= d.steps.length) return STATE.DONE;
      const s = d.steps[n];
      if (s.stepKind === PASS.PREPROCESS) return STATE.PENDING;
      if (s.i === i && s.j === j) return STATE.CURRENT;
      for (let m = n - 1; m >= 0 && d.steps[m].stepKind === s.stepKind; m--) {
        const t = d.steps[m];
        if (t.i === i && t.j === j) {
          const same = s.stepKind === PASS.DKDV ? t.j === s.j : t.i === s.i;
          return same ? STATE.ACCUMULATED : STATE.DONE;
        }
      }
      return STATE.PENDING;
    }

    function drawGrid(n) {
      const pad = 22, w = pad + d.T_c * CELL + 2, h = pad + d.T_r * CELL + 2;
      grid.setAttribute("width", w); grid.setAttribute("height", h); grid.setAttribute("viewBox", `0 0 ${w} ${h}`);
      grid.replaceChildren();
      const text = (x, y, t) => grid.appendChild(el("text", {svg: true, textContent: t,
        attrs: {x, y, "font-size": 10, "text-anchor": "middle"}}));
      for (let j = 0; j < d.T_c; j++) text(pad + j * CELL + CELL / 2, 14, `j=${j}`);
      for (let i = 0; i < d.T_r; i++) {
        text(10, pad + i * CELL + CELL / 2 + 4, i);
        for (let j = 0; j < d.T_c; j++) {
          const state = tileState(n, i, j);
          grid.appendChild(el("rect", {svg: true, dataset: {i, j, state}, attrs: {x: pad + j * CELL,
            y: pad + i * CELL, width: CELL, height: CELL, stroke: "#888", class: state}}));
          if (state === STATE.SKIPPED) text(pad + j * CELL + CELL / 2, pad + i * CELL + CELL / 2 + 4, "×");
        }
      }
    }

    // A named matrix (or vector) as a small table of 4-significant-digit numbers.
    function matrix(name, values, caption = name) {
      const rows = Array.isArray(values[0]) ? values : [values];
      const table = el("table", {className: "matrix", dataset: {name}});
      for (const row of rows) {
        const tr = table.insertRow();
        for (const x of row) tr.insertCell().textContent = fmt(x);
      }
      return el("figure", {className: "bwd-matrix"}, el("figcaption", {textContent: caption}), table);
    }

    function drawEquations(eqs) {
      equations.replaceChildren(...eqs.map(e => el("li", {dataset: {name: e.name}},
        el("span", {className: "line", textContent: e.line === null ? "" : `line ${e.line}`}),
        el("code", {className: "symbolic", textContent: `${e.name} = ${e.symbolic}`}),
        el("code", {className: "substituted", textContent: `= ${e.substituted}`}))));
    }

    function drawResult() {
      const names = Object.keys(d.gradients);
      const table = el("table", {className: "metrics", id: "bwd-errors"});
      for (const name of names) {
        const tr = table.insertRow(); tr.dataset.name = name;
        tr.insertCell().textContent = `max |${name} − oracle|`;
        const td = tr.insertCell(); td.className = "value"; td.textContent = d.maxError[name].toExponential(3);
      }
      const worst = Math.max(...names.map(n => d.maxError[n]));
      result.replaceChildren(el("p", {id: "bwd-worst", dataset: {value: worst},
        textContent: `Against float64 torch.autograd of dense attention: max |grad − oracle| = ${worst.toExponential(3)}`}),
        table);
      matrices.replaceChildren(...names.flatMap(n => [matrix(n, d.gradients[n]), matrix(`${n} (oracle)`, d.oracle[n])]));
    }

    // The kernels' terms at a dK/dV or dQ step: dV_j and dK_j by key row, the rest by query row; a dQ partial of
    // the one-kernel backward also its place among the atomic adds, and the partials of its query block before it.
    const shown = x => x === null ? "∞" : Number(x).toPrecision(3);
    function drawKernel(step) {
      if (!kernel) return;
      kernel.hidden = !(step && step.kernel);
      if (kernel.hidden) return;
      const meta = [`${K.source}, tiles ${K.blockM} × ${K.blockN}. ${K.tiles}`];
      const order = step.kernel.order;
      if (order !== undefined) {
        const before = K.dqOrder.filter(([i, , n]) => i === step.i && n < order).map(([, j]) => `j=${j}`);
        meta.push(`Atomics: this dQ partial reached dQ at place ${order} of the ${K.dqOrder.length} atomic adds ` +
          `(0 first); dQ_i after it holds ${before.length ? `the partials of ${before.join(", ")} and this one`
          : "this partial alone"}. Summed in the reverse order, dQ would move by up to ${shown(K.dqOrderMoves)}.`);
      }
      Page.kernelPanel(kernelBody, step.kernel, {id: "bwd-kernel-terms", meta, note: K.note,
        rowOf: (name, n) => name === "dV_j" || name === "dK_j" ? `key ${step.cols[0] + n}` : `query ${step.rows[0] + n}`});
    }

    const s = Page.stepper(section, total, "Backward step", n => {
      const step = d.steps[n];
      result.hidden = n < d.steps.length;
      equationsTitle.hidden = !result.hidden;
      if (!step) {
        label.textContent = "Result: the gradients";
        position.textContent = `${d.steps.length} steps replayed`;
        equations.replaceChildren();
        drawResult();
      } else if (step.stepKind === PASS.PREPROCESS) {
        label.textContent = "Preprocess: delta = rowsum(dO * O)";
        position.textContent = "before either pass: delta_i = Σ_j P_ij dP_ij over the whole row, so each dS_ij needs only its own tile";
        const x = d.inputs;
        matrices.replaceChildren(matrix("O", x.O), matrix("dO", x.dO), matrix("lse", x.lse), matrix("delta", x.delta));
        drawEquations(step.equations);
      } else {
        const [r0, r1] = step.rows, [c0, c1] = step.cols;
        label.textContent = `${passTitle[step.stepKind]} · tile (i=${step.i}, j=${step.j})`;
        // One step counter, the stepper's: the position names the tile's rows, columns and kind only.
        position.textContent = `query rows ${r0}–${r1 - 1} · key columns ${c0}–${c1 - 1} · ${KIND_NAME[step.kind]}`;
        matrices.replaceChildren(matrix("P_ij", step.P_ij), matrix("dP_ij", step.dP_ij), matrix("dS_ij", step.dS_ij),
          ...Object.entries(step.acc).map(([name, values]) => matrix(name, values, `${name} after this step`)));
        drawEquations(step.equations);
      }
      drawKernel(step && step.stepKind !== PASS.PREPROCESS ? step : null);
      drawGrid(n);
      section.dataset.step = n;
    }, {prev: "bwd-prev", next: "bwd-next", counter: "bwd-counter"});
    section.append(el("p", {className: "meta", textContent: `${d.title} · N_q=${d.N_q}, N_k=${d.N_k} · ` +
      `BLOCK_M=${d.blockM}, BLOCK_N=${d.blockN} · scale ${fmt(d.scale)}` +
      (d.softcap === null ? "" : ` · softcap ${fmt(d.softcap)}`) + (d.sink === null ? "" : ` · sink ${fmt(d.sink)}`)}),
      label, position, el("div", {className: "layout"}, el("div", {}, grid, legend), matrices),
      result, equationsTitle, equations, ...(kernel ? [kernel] : []));
    s.go(0);
    return s;
  }, "Tile replay: backward (FA2 Alg. 2), every tile of both passes");
})();
