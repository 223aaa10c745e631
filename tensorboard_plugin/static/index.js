// Entry point TensorBoard imports (data/plugin_entry.html?name=mpprof):
// the run selector, the view tabs, the state kept in the URL, the theme and
// reloading. Each view is its own module.

import {
  download,
  getJson,
  loadPlotly,
  loadStylesheet,
  preloadPlotly,
  recordedPayloads,
  startRecording,
} from "./static/api.js";
import { compareSeverity, countsText } from "./static/charts.js";
import { el, replace, severityBadges } from "./static/dom.js";
import * as advice from "./static/advice.js";
import * as float8 from "./static/float8.js";
import * as gpu from "./static/gpu.js";
import * as histograms from "./static/histograms.js";
import * as inventory from "./static/inventory.js";
import * as lossScale from "./static/loss_scale.js";
import * as numerics from "./static/numerics.js";
import * as overview from "./static/overview.js";

// `charts`: the view draws plotly charts, so it waits for plotly.js; the
// overview does not and paints without it.
const VIEWS = {
  overview: { title: "Overview", module: overview, charts: false },
  inventory: { title: "Precision inventory", module: inventory, charts: false },
  loss_scale: { title: "Loss scale", module: lossScale, charts: true },
  numerics: { title: "Numerics", module: numerics, charts: true },
  histograms: { title: "Histograms", module: histograms, charts: true },
  gpu: { title: "GPU", module: gpu, charts: true },
  float8: { title: "Float8", module: float8, charts: true },
  advice: { title: "Precision advice", module: advice, charts: false },
};
const AUTO_RELOAD_MS = 30000;
const COMPARED_BY_DEFAULT = 4;
// The state also lives in sessionStorage: TensorBoard's page rebuilds this
// frame without its hash on a reload.
const STORED_STATE = "mpprof:state";

export async function render() {
  loadStylesheet("static/style.css");
  preloadPlotly(); // downloads while the overview paints; runs when a chart view opens
  followTheme();
  const app = new App(document.body);
  followHostReload(() => app.reload());
  await app.start();
}

/**
 * The state in TensorBoard's own URL, so that its address bar can be shared:
 * TensorBoard keeps a plugin's keys in its hash as `p.<plugin>.<key>`
 * (`#mpprof&p.mpprof.view=numerics&...`), the format its plugin API reads.
 */
const hostState = {
  PREFIX: "p.mpprof.",
  host() {
    try {
      return window.parent !== window ? window.parent : null;
    } catch {
      return null;
    }
  },
  /** TensorBoard's hash as [first part (the plugin), [key, value]...]. */
  parse(hash) {
    const [first = "", ...parts] = hash.replace(/^#/, "").split("&");
    const pairs = parts.map((part) => part.split("=")).filter((pair) => pair.length === 2)
      .map(([key, value]) => [decodeURIComponent(key), decodeURIComponent(value)]);
    return [first, pairs];
  },
  /** Our keys as URLSearchParams text (compared runs as one JSON list). */
  read() {
    const host = this.host();
    if (!host) return "";
    try {
      const [, pairs] = this.parse(host.location.hash);
      const params = new URLSearchParams();
      for (const [key, value] of pairs) {
        if (!key.startsWith(this.PREFIX)) continue;
        const name = key.slice(this.PREFIX.length);
        if (name === "compare") for (const run of JSON.parse(value)) params.append(name, run);
        else params.set(name, value);
      }
      return params.toString();
    } catch {
      return "";
    }
  },
  write(params) {
    const host = this.host();
    if (!host) return;
    try {
      const [first, pairs] = this.parse(host.location.hash);
      if (first && first !== "mpprof") return; // TensorBoard shows another tab
      const kept = pairs.filter(([key]) => !key.startsWith(this.PREFIX));
      const ours = [...new Set(params.keys())].map((name) => [
        this.PREFIX + name,
        name === "compare" ? JSON.stringify(params.getAll(name)) : params.get(name),
      ]);
      const hash = ["mpprof", ...[...kept, ...ours].map((pair) => pair.map(encodeURIComponent).join("="))].join("&");
      host.history.replaceState(host.history.state, "", `#${hash}`);
    } catch {
      // another origin: this frame's own hash still holds the state
    }
  },
};

/** TensorBoard's own reload button (in its page, around this frame) reloads the tab too. */
function followHostReload(reload) {
  let host = null;
  try {
    if (window.parent !== window) host = window.parent.document;
  } catch {
    return; // another origin: only the tab's own Reload button
  }
  host?.addEventListener("click", (event) => {
    if (event.target instanceof host.defaultView.Element && event.target.closest(".reload-button")) reload();
  });
}

/**
 * Dark when TensorBoard's page is in dark mode (it sets `dark-mode` on its
 * body), or, opened on its own, when the system prefers dark.
 */
function followTheme() {
  let host = null;
  try {
    if (window.parent !== window) host = window.parent.document.body;
  } catch {
    host = null; // another origin: fall back to the system preference
  }
  const media = window.matchMedia("(prefers-color-scheme: dark)");
  const apply = () => {
    const dark = host ? host.classList.contains("dark-mode") : media.matches;
    if (dark !== document.body.classList.contains("dark")) {
      document.body.classList.toggle("dark", dark);
      document.dispatchEvent(new CustomEvent("mpprof:theme"));
    }
  };
  apply();
  if (host) new MutationObserver(apply).observe(host, { attributes: true, attributeFilter: ["class"] });
  else media.addEventListener("change", apply);
}

class App {
  constructor(root) {
    this.state = { runs: [], focus: null, compare: new Set(), view: "overview", target: {} };
    this.runPicker = el("div", { class: "run-picker" });
    this.status = el("span", { class: "status", role: "status" });
    this.tabs = el("nav", { class: "tabs" });
    this.main = el("main", { class: "view" });
    const reload = el("button", { type: "button", class: "reload", onclick: () => this.reload() }, "Reload");
    const auto = el("input", { type: "checkbox", onchange: (e) => this.autoReload(e.target.checked) });
    const downloads = el(
      "span",
      { class: "downloads" },
      el("button", { type: "button", class: "download-json", onclick: () => this.download("json") }, "Data (JSON)"),
      el("button", { type: "button", class: "download-csv", onclick: () => this.download("csv") }, "CSV"),
    );
    replace(
      root,
      el(
        "header",
        { class: "toolbar" },
        el("strong", { class: "brand" }, "mpprof"),
        this.runPicker,
        reload,
        el("label", { class: "auto-reload" }, auto, " auto-reload"),
        downloads,
        this.status,
      ),
      this.tabs,
      this.main,
    );
    for (const [name, view] of Object.entries(VIEWS)) {
      this.tabs.append(
        // The layer shown stays (the URL keeps it); a finding's step does not.
        el("button", { type: "button", "data-view": name, onclick: () => this.show(name, this.keptLayer()) }, view.title),
      );
    }
    // Redraw the charts in the new theme.
    document.addEventListener("mpprof:theme", () => {
      if (VIEWS[this.state.view]?.charts) this.show(this.state.view, this.state.target);
    });
  }

  async start() {
    this.restoreState();
    await this.reload();
  }

  /**
   * Reads view, focus run, compared runs, layer and step from this frame's
   * URL hash (a link to the tab alone), else from TensorBoard's URL (its
   * `p.mpprof.*` keys), else from the session.
   */
  restoreState() {
    let text = location.hash.slice(1) || hostState.read();
    if (!text) {
      try {
        text = sessionStorage.getItem(STORED_STATE) || "";
      } catch {
        text = "";
      }
    }
    const params = new URLSearchParams(text);
    const view = params.get("view");
    if (view in VIEWS) this.state.view = view;
    this.state.focus = params.get("run");
    const compared = params.getAll("compare");
    if (compared.length) this.state.compare = new Set(compared);
    const target = {};
    if (params.get("layer")) target.layer = params.get("layer");
    const step = Number.parseInt(params.get("step"), 10);
    if (Number.isInteger(step)) target.step = step;
    this.state.target = target;
  }

  /** Writes the state into the URL hash: a reload or a shared link shows the same. */
  saveState() {
    const { view, focus, compare, target } = this.state;
    const params = new URLSearchParams({ view });
    if (focus) params.set("run", focus);
    for (const name of compare) params.append("compare", name);
    if (target.layer) params.set("layer", target.layer);
    if (Number.isInteger(target.step)) params.set("step", String(target.step));
    const text = params.toString();
    history.replaceState(null, "", `${location.pathname}${location.search}#${text}`);
    hostState.write(params);
    try {
      sessionStorage.setItem(STORED_STATE, text);
    } catch {
      // storage disabled: the hash still holds the state
    }
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
    if (!names.includes(this.state.focus)) this.state.focus = worstRun(payload.runs);
    const kept = [...this.state.compare].filter((name) => names.includes(name));
    this.state.compare = new Set(kept.length ? kept : mostSevere(payload.runs, COMPARED_BY_DEFAULT));
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
      runs.map((run) => el("option", { value: run.run, selected: run.run === focus }, runLabel(run), ` — ${countsText(run.findings)}`)),
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
        severityBadges(run.findings),
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

  keptLayer() {
    return this.state.target.layer ? { layer: this.state.target.layer } : {};
  }

  setCompared(name, checked) {
    if (checked) this.state.compare.add(name);
    else this.state.compare.delete(name);
    this.show(this.state.view, this.state.target);
  }

  /** Shows a view; `target` ({layer, step}) is what a finding or a click links to. */
  async show(view, target = {}) {
    this.state.view = view;
    this.state.target = target;
    this.saveState();
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
    this.csv = null;
    startRecording();
    const runIndex = new Map(this.state.runs.map((run, i) => [run.run, i]));
    const context = {
      focus: this.state.focus,
      runs: this.state.runs,
      runIndex: (name) => runIndex.get(name) ?? 0,
      compared: this.state.runs.filter((run) => this.state.compare.has(run.run) || run.run === this.state.focus),
      target,
      navigate: (name, next) => this.show(name, next),
      // A view that shows a table offers it as CSV.
      offerCsv: (name, rows) => {
        this.csv = { name, rows };
      },
      // The layer shown in a view's detail, kept in the URL.
      setLayer: (layer) => {
        this.state.target = { ...this.state.target, layer };
        this.saveState();
      },
    };
    try {
      if (VIEWS[view].charts) {
        this.say("loading plotly…");
        context.plotly = await loadPlotly();
        if (!current()) return;
      }
      this.say("loading…");
      await VIEWS[view].module.show(container, context);
      if (!current()) return;
      this.say(`updated ${new Date().toLocaleTimeString()}`);
      this.main.dataset.state = "ready";
      performance.mark(`mpprof:${view}:ready`);
      // The overview paints without plotly; run it once the page is idle, so
      // that the chart views open at once.
      if (!VIEWS[view].charts) whenIdle(() => loadPlotly().catch(() => {}));
    } catch (error) {
      if (!current()) return;
      container.append(el("p", { class: "error" }, error.message));
      this.say("failed");
      this.main.dataset.state = "failed";
    }
  }

  download(format) {
    // Run and layer names are the user's: only safe characters in a file name.
    const fileName = (...parts) => parts.join("-").replace(/[^\w.-]+/g, "_");
    const stem = ["mpprof", this.state.view, this.state.focus || "runs"];
    if (format === "csv") {
      if (!this.csv) {
        this.say("this view has no table to save as CSV: save its data as JSON");
        return;
      }
      download(`${fileName(...stem, this.csv.name)}.csv`, toCsv(this.csv.rows), "text/csv");
      return;
    }
    download(`${fileName(...stem)}.json`, JSON.stringify(recordedPayloads(), null, 1), "application/json");
  }

  say(text) {
    this.status.textContent = text;
  }
}

function whenIdle(work) {
  if (window.requestIdleCallback) window.requestIdleCallback(work, { timeout: 2000 });
  else setTimeout(work, 200);
}

/** The run with the most severe findings (the first listed on a tie). */
function worstRun(runs) {
  return mostSevere(runs, 1)[0] ?? null;
}

function mostSevere(runs, count) {
  return [...runs].sort(compareSeverity).slice(0, count).map((run) => run.run);
}

function runLabel(run) {
  return run.model_policy ? `${run.run} (${run.model_policy})` : run.run;
}

/** Rows (arrays) as CSV text, each cell quoted when it must be. */
function toCsv(rows) {
  const cell = (value) => {
    let text = value === null || value === undefined ? "" : String(value);
    // A name starting with "=" would be a formula in a spreadsheet.
    if (typeof value === "string" && /^[=+\-@\t\r]/.test(text)) text = `'${text}`;
    return /[",\n\r]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
  };
  return rows.map((row) => row.map(cell).join(",")).join("\r\n") + "\r\n";
}
