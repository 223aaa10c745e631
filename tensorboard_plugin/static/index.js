// Entry point TensorBoard imports (data/plugin_entry.html?name=mpprof):
// the run selector, the view tabs and reloading. Each view is its own module.

import { getJson, loadPlotly, loadStylesheet } from "./static/api.js";
import { el, replace } from "./static/dom.js";
import * as gpu from "./static/gpu.js";
import * as inventory from "./static/inventory.js";
import * as lossScale from "./static/loss_scale.js";
import * as numerics from "./static/numerics.js";
import * as overview from "./static/overview.js";

const VIEWS = {
  overview: { title: "Overview", module: overview },
  inventory: { title: "Precision inventory", module: inventory },
  loss_scale: { title: "Loss scale", module: lossScale },
  numerics: { title: "Numerics", module: numerics },
  gpu: { title: "GPU", module: gpu },
};
const AUTO_RELOAD_MS = 30000;
const COMPARED_BY_DEFAULT = 4;

export async function render() {
  loadStylesheet("static/style.css");
  const app = new App(document.body);
  await app.start();
}

class App {
  constructor(root) {
    this.state = { runs: [], focus: null, compare: new Set(), view: "overview", target: {} };
    this.runPicker = el("div", { class: "run-picker" });
    this.status = el("span", { class: "status", role: "status" });
    this.tabs = el("nav", { class: "tabs" });
    this.main = el("main", { class: "view" });
    const reload = el("button", { type: "button", onclick: () => this.reload() }, "Reload");
    const auto = el("input", { type: "checkbox", onchange: (e) => this.autoReload(e.target.checked) });
    replace(
      root,
      el(
        "header",
        { class: "toolbar" },
        el("strong", { class: "brand" }, "mpprof"),
        this.runPicker,
        reload,
        el("label", { class: "auto-reload" }, auto, " auto-reload"),
        this.status,
      ),
      this.tabs,
      this.main,
    );
    for (const [name, view] of Object.entries(VIEWS)) {
      this.tabs.append(
        el("button", { type: "button", "data-view": name, onclick: () => this.show(name) }, view.title),
      );
    }
  }

  async start() {
    this.say("loading plotly…");
    try {
      this.plotly = await loadPlotly();
    } catch (error) {
      this.say(error.message);
      return;
    }
    await this.reload();
  }

  /** Re-reads the run list and redraws the current view (new data while training). */
  async reload() {
    this.say("loading…");
    let payload;
    try {
      payload = await getJson("runs");
    } catch (error) {
      this.say(error.message);
      return;
    }
    const names = payload.runs.map((run) => run.run);
    this.state.runs = payload.runs;
    if (!names.includes(this.state.focus)) this.state.focus = names[0] ?? null;
    const kept = [...this.state.compare].filter((name) => names.includes(name));
    this.state.compare = new Set(kept.length ? kept : names.slice(0, COMPARED_BY_DEFAULT));
    this.drawRunPicker();
    await this.show(this.state.view, this.state.target);
  }

  autoReload(enabled) {
    clearInterval(this.timer);
    if (enabled) this.timer = setInterval(() => this.reload(), AUTO_RELOAD_MS);
  }

  drawRunPicker() {
    const { runs, focus, compare } = this.state;
    const select = el(
      "select",
      { "aria-label": "run", onchange: (e) => this.setFocus(e.target.value) },
      runs.map((run) => el("option", { value: run.run, selected: run.run === focus }, runLabel(run))),
    );
    const boxes = runs.map((run) =>
      el(
        "label",
        { class: "compare-run" },
        el("input", {
          type: "checkbox",
          checked: compare.has(run.run),
          onchange: (e) => this.setCompared(run.run, e.target.checked),
        }),
        runLabel(run),
      ),
    );
    replace(
      this.runPicker,
      el("label", {}, "Run ", select),
      runs.length > 1 ? el("span", { class: "compare" }, "Compare: ", boxes) : null,
    );
  }

  setFocus(name) {
    this.state.focus = name;
    this.state.compare.add(name);
    this.drawRunPicker();
    this.show(this.state.view);
  }

  setCompared(name, checked) {
    if (checked) this.state.compare.add(name);
    else this.state.compare.delete(name);
    this.show(this.state.view, this.state.target);
  }

  /** Shows a view; `target` ({layer, step}) is what a finding links to. */
  async show(view, target = {}) {
    this.state.view = view;
    this.state.target = target;
    for (const tab of this.tabs.children) {
      tab.classList.toggle("active", tab.dataset.view === view);
    }
    if (!this.state.focus) {
      replace(this.main, el("p", { class: "not-measured" }, "No mpprof runs in this logdir yet."));
      this.say("");
      return;
    }
    // A later show() (a click, a reload) supersedes this one.
    const generation = (this.generation = (this.generation ?? 0) + 1);
    const current = () => generation === this.generation;
    const container = el("section", { class: `view-${view}` });
    replace(this.main, container);
    // data-state lets tests (and users' scripts) wait for a view to finish.
    this.main.dataset.view = view;
    this.main.dataset.state = "loading";
    this.say("loading…");
    const context = {
      plotly: this.plotly,
      focus: this.state.focus,
      compared: this.state.runs.filter((run) => this.state.compare.has(run.run) || run.run === this.state.focus),
      target,
      navigate: (name, next) => this.show(name, next),
    };
    try {
      await VIEWS[view].module.show(container, context);
      if (!current()) return;
      this.say(`updated ${new Date().toLocaleTimeString()}`);
      this.main.dataset.state = "ready";
      performance.mark(`mpprof:${view}:ready`);
    } catch (error) {
      if (!current()) return;
      container.append(el("p", { class: "error" }, error.message));
      this.say("failed");
      this.main.dataset.state = "failed";
    }
  }

  say(text) {
    this.status.textContent = text;
  }
}

function runLabel(run) {
  return run.model_policy ? `${run.run} (${run.model_policy})` : run.run;
}
