// JSON routes of the plugin, relative to the document's base
// (data/plugin/mpprof/ inside TensorBoard).

export class RouteError extends Error {}

// What the current view fetched, by route and parameters: the "Download
// data" button saves it. `startRecording` empties it when a view starts.
let recorded = new Map();

export function startRecording() {
  recorded = new Map();
}

export function recordedPayloads() {
  return Object.fromEntries(recorded);
}

// A run name that is not valid Unicode (a directory name that is not UTF-8,
// read by Python as lone surrogates) would reach the server as U+FFFD in a
// URL: such a name goes as its JSON text ("run_json"), which keeps every
// code unit, and the server reads it back exactly.
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function runParameter([key, value]) {
  return key === "run" && typeof value === "string" && LONE_SURROGATE.test(value)
    ? ["run_json", JSON.stringify(value)]
    : [key, value];
}

export async function getJson(route, params = {}) {
  const query = new URLSearchParams(
    Object.entries(params)
      .filter(([, value]) => value !== undefined && value !== null)
      .map(runParameter),
  );
  const response = await fetch(`${route}?${query}`, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    throw new RouteError(`${route}: ${response.status} ${(await response.text()).slice(0, 300)}`);
  }
  const payload = await response.json();
  recorded.set(`${route}?${query}`, payload);
  return payload;
}

let plotlyLoading = null;
const PLOTLY = "plotly.min.js";

/**
 * Starts downloading plotly.js without running it: parsing 4.8 MB of
 * JavaScript would hold up the first paint; `loadPlotly` runs it later.
 */
export function preloadPlotly() {
  if (window.Plotly || document.querySelector(`link[rel=preload][href="${PLOTLY}"]`)) return;
  performance.mark("mpprof:plotly:requested");
  document.head.append(Object.assign(document.createElement("link"), { rel: "preload", as: "script", href: PLOTLY }));
}

/**
 * Loads plotly.js (1.6 MB gzipped), served by the plugin from the installed
 * plotly package, once: only views with charts wait for it.
 */
export function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  preloadPlotly();
  plotlyLoading ??= new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = PLOTLY;
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => {
      plotlyLoading = null;
      reject(new RouteError("plotly.min.js could not be loaded"));
    };
    document.head.append(script);
  });
  return plotlyLoading;
}

export function loadStylesheet(href) {
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = href;
  document.head.append(link);
}

/** Saves `text` as a file named `name` (a download, as TensorBoard's scalars offer). */
export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = Object.assign(document.createElement("a"), { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
