// The decode step's page (html.py): every split's tile updates, then the merges of the split results,
// the sink merged in last when there is one, and the result against the dense oracle. The cache strip shows
// each slot's role (old, new, unused), split and, in a paged cache, page, block id and slot; the current
// event's keys are highlighted. Equations come with their numbers, one query row at a time. With source="triton"
// each tile update and merge also shows the kernel's terms beside the reference's (d.kernel, e.kernel:
// kernel_view_decode.py; the partials, the merged O and lse), drawn by page_kernel.js's Page.kernelPanel.
(() => {
  const {enums, fmt, el, substituted} = Page;
  const EVENT = enums.DecodeEvent, STATE = enums.TileState, ROLE = enums.KeyRole;
  const KIND_NAME = Object.fromEntries(Object.entries(enums.TileKind).map(([name, value]) => [value, name]));

  Page.addView("decode", "Decode step", (section, d) => {
    const events = d.events, paged = d.pageSize !== null, L = d.cacheLen + d.newKeys;
    let row = 0;  // the query row whose equations are shown, kept while stepping

    document.getElementById("title").textContent = d.title;
    document.getElementById("meta").textContent = `batch element ${d.batchIndex}, head ${d.head} · ` +
      `${d.cacheLen} cached + ${d.newKeys} new keys (L=${L}) of ${d.cacheSize} slots · N_new=${d.newQueries} ` +
      `queries · ${d.numSplits} splits, BLOCK_N=${d.blockN} · scale ${fmt(d.scale)}` +
      (paged ? ` · paged, page_size ${d.pageSize}, pages [${d.pages.join(", ")}]` : "") +
      (d.labels.length ? ` · ${d.labels.join(", ")}` : "");

    const label = el("h2", {id: "dec-label"}), position = el("p", {className: "meta", id: "dec-position"});
    const cache = el("table", {className: "dec-cache", id: "dec-cache"});
    const legend = el("div", {className: "legend"},
      ...[[STATE.CURRENT, "this event"], [STATE.ACCUMULATED, "folded in / merged"], [STATE.DONE, "computed"],
        [STATE.PENDING, "later"], [STATE.SKIPPED, "never read"]].map(([s, t]) => el("span", {}, el("i", {className: s}), t)));
    const rows = el("div", {className: "equation-rows", id: "dec-rows", attrs: {role: "group", "aria-label": "query row shown"}});
    const body = el("div", {className: "dec-body", id: "dec-body"});
    const equationsTitle = el("h2", {id: "dec-equations-title"});
    const equations = el("ol", {className: "dec-equations", id: "dec-equations"});
    const K = d.kernel, kernelBody = el("div", {className: "panel-body"});  // K: absent for the reference alone
    const kernel = K ? el("div", {className: "panel", id: "dec-kernel"},
      el("h2", {textContent: "Kernel beside reference"}), kernelBody) : null;

    // The kernel's terms at a tile update or merge, one query row a row (a merge's: the kernel's partials, the
    // last merge also its merged O and lse; the combine kernel's running values between merges are not traced).
    function drawKernel(e) {
      if (!kernel) return;
      kernel.hidden = !e.kernel;
      if (kernel.hidden) return;
      const meta = [`${K.source}, BLOCK_N ${K.blockN}, ${K.numSplits} splits: keys ` +
        K.ranges.map(([a, b]) => a < b ? `${a}–${b - 1}` : "none").join(", ") + `. ${K.tiles}`];
      Page.kernelPanel(kernelBody, e.kernel, {id: "dec-kernel-terms", meta, note: K.note, rowOf: (_, n) => `q${n}`});
    }

    // The state of cache slot j (or of the sink, j = "sink") at event n.
    function slotState(n, j) {
      const e = events[n], split = j === "sink" ? null : d.slots[j].split;
      if (j === "sink") {
        if (e.event === EVENT.MERGE && e.split === null) return STATE.CURRENT;
        return e.event === EVENT.RESULT ? STATE.DONE : STATE.PENDING;
      }
      if (split === null) return STATE.SKIPPED;
      if (e.event === EVENT.RESULT) return STATE.DONE;
      if (e.event === EVENT.TILE) {
        if (j >= e.cols[0] && j < e.cols[1]) return STATE.CURRENT;
        if (split === e.split) return j < e.cols[0] ? STATE.ACCUMULATED : STATE.PENDING;
        return split < e.split ? STATE.DONE : STATE.PENDING;
      }
      if (split === e.split) return STATE.CURRENT;
      return e.merged.includes(split) ? STATE.ACCUMULATED : STATE.DONE;
    }

    function drawCache(n) {
      cache.replaceChildren();
      const keys = d.slots.map(s => s.key), sink = d.sink !== null;
      const line = (name, cells, sinkCell = "") => {
        const tr = cache.insertRow(); tr.dataset.name = name;
        tr.append(el("th", {scope: "row", textContent: name}));
        if (sink) tr.append(el("td", {className: slotState(n, "sink"), dataset: {key: "sink"}, textContent: sinkCell}));
        cells.forEach((text, j) => tr.append(el("td", {className: slotState(n, j), dataset: {key: j}, textContent: text})));
      };
      line("key", keys.map(String), "sink");
      line("role", d.slots.map(s => s.role), fmt(d.sink));
      line("split", d.slots.map(s => s.split === null ? "·" : String(s.split)));
      if (paged) {
        line("page", d.slots.map(s => s.page === null ? "·" : String(s.page)));
        line("block", d.slots.map(s => s.block === null ? "·" : String(s.block)));
        line("slot", d.slots.map(s => s.slot === null ? "·" : String(s.slot)));
      }
      d.visible.forEach((seen, i) => line(`q${i}`, [...seen].map(c => c === "1" ? "✓" : "·"), "✓"));
    }

    // A named matrix (or vector) as a small table of 4-significant-digit numbers.
    function matrix(name, values, caption = name) {
      const table = el("table", {className: "matrix", dataset: {name}});
      for (const r of Array.isArray(values[0]) ? values : [values]) {
        const tr = table.insertRow();
        for (const x of r) tr.insertCell().textContent = fmt(x);
      }
      return el("figure", {className: "dec-matrix"}, el("figcaption", {textContent: caption}), table);
    }

    // The keys of the current tile: role and, in a paged cache, where each lives.
    function tileKeys(e) {
      const head = ["key", "role", ...(paged ? ["page", "block id", "slot"] : [])];
      const table = el("table", {className: "metrics dec-keys", id: "dec-keys"});
      table.append(el("tr", {}, ...head.map(h => el("th", {textContent: h}))));
      for (let j = e.cols[0]; j < e.cols[1]; j++) {
        const s = d.slots[j], tr = table.insertRow();
        tr.dataset.key = j;
        for (const x of [j, s.role === ROLE.OLD ? "cached (old)" : s.role, ...(paged ? [s.page, s.block, s.slot] : [])])
          tr.insertCell().textContent = x === null ? "·" : String(x);
      }
      return el("figure", {className: "dec-matrix"}, el("figcaption", {textContent: "Keys of this tile"}), table);
    }

    function drawEquations(list, lineOf) {
      equations.replaceChildren(...list.map(e => {
        const li = el("li", {dataset: {name: e.name}},
          el("span", {className: "line", textContent: lineOf(e)}),
          el("code", {className: "symbolic", textContent: e.symbolic}),
          el("div", {className: "substituted"}, ...substituted(e.parts)));
        if (e.note) li.append(el("div", {className: "note", textContent: e.note}));
        return li;
      }));
    }

    function drawRows(n) {
      rows.replaceChildren(...Array.from({length: d.newQueries}, (_, r) => {
        const b = el("button", {type: "button", textContent: `row ${r}`, dataset: {row: r}});
        b.setAttribute("aria-pressed", String(r === row));
        b.addEventListener("click", () => { row = r; show(n); rows.querySelector(`[data-row="${r}"]`).focus(); });
        return b;
      }));
    }

    function showTile(e) {
      const [c0, c1] = e.cols;
      label.textContent = `Split ${e.split} · tile update ${e.update} of ${e.updates} · keys ${c0}–${c1 - 1}`;
      position.textContent = `split ${e.split} holds keys ${e.splitKeys[0]}–${e.splitKeys[1] - 1} and runs its own ` +
        `online softmax from m_i = −∞, l_i = 0 · ${KIND_NAME[e.tileKind]} tile · ` +
        `max |acc / l_i − O_final| = ${e.maxDiff.toExponential(3)}`;
      const parts = [tileKeys(e), matrix("m_i", e.m), matrix("l_i", e.l), matrix("O_partial", e.output, "acc / l_i")];
      if (e.partial) parts.push(matrix("O_s", e.partial.output, `O_s (split ${e.split})`),
        matrix("lse_s", e.partial.lse, `lse_s (split ${e.split})`));
      body.replaceChildren(...parts);
      equationsTitle.textContent = `FA2 Alg. 1 with this update's numbers, row ${row}`;
      drawEquations(e.equations.rows[row], eq => `line ${eq.line}`);
    }

    function showMerge(e) {
      const sink = e.split === null;
      label.textContent = `Merge ${e.merge} · ${e.label}`;
      position.textContent = sink
        ? `the sink joins once per row after the splits: the partial (O_b = 0, lse_b = sink_h = ${fmt(d.sink)}); ` +
          `its weight w_b is the sink's share of the row · max |O − O_final| = ${e.maxDiff.toExponential(3)}`
        : `splits (${e.merged.join(" ")}) so far, with split ${e.split}'s partial · ` +
          `max |O − O_final| = ${e.maxDiff.toExponential(3)}`;
      body.replaceChildren(matrix("lse_a", e.lseA), matrix("lse_b", e.lseB, sink ? "lse_b = sink_h" : "lse_b"),
        matrix("lse", e.lse), matrix("w_a", e.weightA),
        matrix("w_b", e.weightB, sink ? "w_b (the sink's share)" : "w_b"),
        matrix("O_a", e.outputA), matrix("O_b", e.outputB), matrix("O", e.output, "O after the merge"));
      equationsTitle.textContent = `The merge with its numbers, row ${row} (${d.source})`;
      drawEquations(e.equations[row], () => "merge");
    }

    function showResult(e) {
      label.textContent = "Result: the decode output against the dense oracle";
      position.textContent = `dense float64 attention over keys 0–${L - 1} with the same masks` +
        (d.sink === null ? "" : " and the sink as one more column");
      body.replaceChildren(matrix("O", e.output, "O (decode)"), matrix("O_final", e.denseOutput, "O (dense oracle)"),
        matrix("lse", e.lse, "lse (decode)"), matrix("lse_final", e.denseLse, "lse (dense oracle)"),
        el("p", {id: "dec-error", dataset: {value: e.maxDiff},
          textContent: `max |O − O_final| = ${e.maxDiff.toExponential(3)}`}));
      equationsTitle.textContent = "";
      equations.replaceChildren();
    }

    function show(n) {
      const e = events[n];
      row = Math.min(row, d.newQueries - 1);
      section.dataset.step = n;
      section.dataset.event = e.event;
      drawCache(n);
      rows.hidden = equationsTitle.hidden = e.event === EVENT.RESULT;
      if (rows.hidden) rows.replaceChildren(); else drawRows(n);
      if (e.event === EVENT.TILE) showTile(e);
      else if (e.event === EVENT.MERGE) showMerge(e);
      else showResult(e);
      drawKernel(e);
    }

    const s = Page.stepper(section, events.length, "Event", show, {prev: "dec-prev", next: "dec-next", counter: "dec-counter"});
    section.append(label, position, el("div", {className: "scroll"}, cache), legend, body, equationsTitle, rows, equations,
      ...(kernel ? [kernel] : []));
    s.go(0);
    return s;
  });
})();
