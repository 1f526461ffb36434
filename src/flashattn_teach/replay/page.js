// The replay page's core (flashattn_teach/trace/html.py): the data, the tabs, the steppers and the keys.
// Each view is its own script (page_<view>.js), concatenated after this one; it registers itself with
// Page.addView (its own tab and stepper) or Page.addForwardPanel (a panel of the forward view, drawn at
// every forward tile update). Page.start() runs last.
const Page = (() => {
  const json = id => JSON.parse(document.getElementById(id).textContent);
  const data = json("replay-data");  // the experiment (manifest.py), with its extensions
  // The Python enums TileState and TileKind, as {NAME: value}, so no state is spelt here a second time.
  const enums = json("replay-enums");
  const views = json("view-data");  // {key: payload}: each view's data, built by its Python builder
  const fmt = x => x === null ? "−∞" : Number(x).toPrecision(4);
  const number = x => el("span", {className: "num", textContent: fmt(x)});

  // An equation's numbers put in: parts are text (strings), numbers (null: −∞) and rows of numbers, in the
  // order of the substituted text (equations.py, html.py); each number a span.num.
  function substituted(parts) {
    const out = [];
    for (const p of parts) {
      if (typeof p === "string") out.push(p);
      else if (Array.isArray(p)) {
        out.push("[");
        p.forEach((x, k) => { if (k) out.push(", "); out.push(number(x)); });
        out.push("]");
      } else out.push(number(p));
    }
    return out;
  }
  const registered = [], panels = [];
  let active = null;

  // el("div", {className: "x", dataset: {row: 1}, hidden: true}, child, "text", ...)
  function el(tag, props = {}, ...children) {
    const e = tag === "svg" || props.svg ? document.createElementNS("http://www.w3.org/2000/svg", tag)
      : document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "svg") continue;
      if (key === "dataset") Object.assign(e.dataset, value);
      else if (key === "attrs") for (const [a, v] of Object.entries(value)) e.setAttribute(a, v);
      else e[key] = value;
    }
    e.append(...children);
    return e;
  }

  // prev / counter / next in `root`; show(n) draws step n (0-based). Returns {go(n), step(delta), index()}.
  function stepper(root, count, label, show, ids = {}) {
    const prev = el("button", {type: "button", id: ids.prev || "", textContent: "◀ prev"});
    const next = el("button", {type: "button", id: ids.next || "", textContent: "next ▶"});
    const counter = el("span", {id: ids.counter || "", className: "counter"});
    prev.setAttribute("aria-label", `previous ${label.toLowerCase()}`);
    next.setAttribute("aria-label", `next ${label.toLowerCase()}`);
    root.append(el("div", {className: "controls"}, prev, counter, next,
      el("span", {className: "meta", textContent: "(or ← / → keys)"})));
    let index = 0;
    const go = n => {
      if (!count) { counter.textContent = `No ${label.toLowerCase()}s`; prev.disabled = next.disabled = true; return; }
      index = Math.max(0, Math.min(count - 1, n));
      counter.textContent = `${label} ${index + 1} of ${count}`;
      prev.disabled = index === 0; next.disabled = index === count - 1;
      show(index);
    };
    prev.addEventListener("click", () => go(index - 1));
    next.addEventListener("click", () => go(index + 1));
    return {go, step: d => go(index + d), index: () => index};
  }

  // A view: a tab and its section. build(section, payload) draws it and returns its stepper (or null);
  // heading, when given, becomes the page's title (h1 and document.title) while the view is shown.
  function addView(key, title, build, heading = null) {
    if (key !== "forward" && !(key in views)) return;  // the Python side built nothing for this view
    registered.push({key, title, build, heading});
  }

  // A panel of the forward view: draw(body, case, index) at every forward tile update.
  function addForwardPanel(id, title, draw) { panels.push({id, title, draw}); }

  // Every tab stays in the Tab order (Enter or Space opens it): the arrow keys step, on a tab too.
  function select(view) {
    active = view;
    for (const v of registered) {
      v.section.hidden = v !== view;
      v.tab.setAttribute("aria-selected", String(v === view));
    }
    document.body.dataset.view = view.key;
    if (view.heading) document.getElementById("title").textContent = document.title = view.heading;
  }

  function start() {
    const tabs = document.getElementById("tabs"), root = document.getElementById("views");
    for (const v of registered) {
      v.tab = el("button", {type: "button", id: `tab-${v.key}`, textContent: v.title, attrs: {role: "tab"}});
      v.section = el("section", {id: `view-${v.key}`, className: "view", attrs: {role: "tabpanel"}});
      v.section.setAttribute("aria-labelledby", v.tab.id);
      v.tab.addEventListener("click", () => select(v));
      tabs.appendChild(v.tab); root.appendChild(v.section);
      v.stepper = v.build(v.section, v.key === "forward" ? data : views[v.key]);
    }
    tabs.hidden = registered.length < 2;
    document.addEventListener("keydown", e => {
      if (!active || !active.stepper || e.altKey || e.ctrlKey || e.metaKey) return;
      if (e.key === "ArrowRight") { active.stepper.step(1); e.preventDefault(); }
      if (e.key === "ArrowLeft") { active.stepper.step(-1); e.preventDefault(); }
    });
    const first = registered.find(v => v.key === data.openView) || registered[0];
    if (first) select(first);
  }

  return {data, enums, views, fmt, el, substituted, stepper, addView, addForwardPanel, panels, start};
})();
