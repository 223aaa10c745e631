// JSON routes of the plugin, relative to the document's base
// (data/plugin/mpprof/ inside TensorBoard).

export class RouteError extends Error {}

export async function getJson(route, params = {}) {
  const query = new URLSearchParams(
    Object.entries(params).filter(([, value]) => value !== undefined && value !== null),
  );
  const response = await fetch(`${route}?${query}`, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    throw new RouteError(`${route}: ${response.status} ${(await response.text()).slice(0, 300)}`);
  }
  return response.json();
}

/** Loads plotly.js, served by the plugin from the installed plotly package. */
export function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  return new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = "plotly.min.js";
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => reject(new RouteError("plotly.min.js could not be loaded"));
    document.head.append(script);
  });
}

export function loadStylesheet(href) {
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = href;
  document.head.append(link);
}
