// What every chart shares: the theme (light, or TensorBoard's dark mode),
// run colours, plotly's config and the severity order.

// TensorBoard's default run colour palette, by the run's place in the list.
const RUN_COLORS = ["#425066", "#12b5cb", "#e52592", "#f9ab00", "#9334e6", "#7cb342", "#e8710a"];
const DARK_RUN_COLORS = ["#8ab4f8", "#12b5cb", "#f48fb1", "#f9ab00", "#c58af9", "#9ccc65", "#fcad70"];
export const SEVERITIES = ["critical", "warning", "info"];

export function isDark() {
  return document.body.classList.contains("dark");
}

export function runColor(index) {
  const palette = isDark() ? DARK_RUN_COLORS : RUN_COLORS;
  return palette[index % palette.length];
}

/** Colours a chart needs beyond its data: text, grid, "no data" background. */
export function themeColors() {
  return isDark()
    ? { text: "#e0e0e0", grid: "#424242", noData: "#616161", paper: "#202124", line: "#f28b82" }
    : { text: "#212121", grid: "#e0e0e0", noData: "#bdbdbd", paper: "#ffffff", line: "#d62728" };
}

/** plotly.newPlot with the theme and the plugin's config. */
export function plot(plotly, div, traces, layout) {
  const colors = themeColors();
  const axis = (a = {}) => ({ gridcolor: colors.grid, zerolinecolor: colors.grid, ...a });
  return plotly.newPlot(
    div,
    traces,
    {
      paper_bgcolor: colors.paper,
      plot_bgcolor: colors.paper,
      font: { color: colors.text },
      ...layout,
      xaxis: axis(layout.xaxis),
      yaxis: axis(layout.yaxis),
    },
    { responsive: true, displaylogo: false },
  );
}

/** How severe a run is, for sorting: more criticals first, then warnings, infos. */
export function severityKey(run) {
  const counts = run.findings || {};
  return SEVERITIES.map((severity) => counts[severity] || 0);
}

export function compareSeverity(a, b) {
  const [x, y] = [severityKey(a), severityKey(b)];
  for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return y[i] - x[i];
  return 0;
}

/** "2 critical, 1 warning" (or "no findings"). */
export function countsText(counts = {}) {
  const parts = SEVERITIES.filter((s) => counts[s]).map((s) => `${counts[s]} ${s}`);
  return parts.length ? parts.join(", ") : "no findings";
}

/** An x axis of train steps: whole numbers only, even over a few steps. */
export function stepAxis(steps = []) {
  const span = steps.length ? steps.at(-1) - steps[0] : 0; // sorted
  return { title: { text: "train step" }, tickformat: "d", ...(span < 10 ? { dtick: 1 } : {}) };
}
