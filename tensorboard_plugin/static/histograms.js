// The recorded log2-magnitude histograms of one layer of the focus run: a
// heatmap of binades (y) over sampled steps (x), with the run dtype's
// largest value, smallest normal and smallest subnormal as lines. Values
// above the top line overflow; below the middle one they lose precision;
// below the bottom one they flush to zero.

import { getJson } from "./api.js";
import { plot, stepAxis, themeColors } from "./charts.js";
import { el, notMeasured, plotlyText, replace } from "./dom.js";

export async function show(container, context) {
  const { focus, target } = context;
  // The layer list, in call order, from a one-column heatmap.
  const listing = await getJson("numerics", { run: focus, direction: "forward", stat: "abs_max", columns: 1, rows: 5000 });
  if (!listing.available) {
    container.append(notMeasured("Histograms", listing.reason));
    return;
  }
  const layers = listing.row_layers;
  const state = { layer: layers.includes(target.layer) ? target.layer : layers[0], direction: "forward" };
  const chart = el("div", { class: "chart histogram-chart" });
  const draw = async () => {
    context.setLayer(state.layer);
    await drawHistogram(chart, context, state);
  };
  container.append(
    el(
      "div",
      { class: "filters" },
      el("label", {}, "Layer ", el("select", { "aria-label": "layer", onchange: (e) => { state.layer = e.target.value; draw(); } },
        layers.map((layer) => el("option", { value: layer, selected: layer === state.layer }, layer)))),
      el("label", {}, "Values ", el("select", { "aria-label": "direction", onchange: (e) => { state.direction = e.target.value; draw(); } },
        el("option", { value: "forward" }, "activations (layer output)"),
        el("option", { value: "backward" }, "gradients into the output (scaled)"))),
    ),
    el("p", { class: "hint" }, "Each column: how a sample's finite non-zero values spread over binades (2 binades per bin; the end bins are open). Zeros and non-finite values are not in it: see the Numerics view."),
    chart,
  );
  await draw();
}

async function drawHistogram(chart, { plotly, focus, offerCsv }, { layer, direction }) {
  const columns = Math.max(50, Math.min(1000, Math.round(chart.clientWidth || 800)));
  const payload = await getJson("histogram", { run: focus, layer, direction, columns });
  if (!payload.available) {
    replace(chart, notMeasured("Histogram", payload.reason));
    return;
  }
  const edges = payload.edges;
  const step = edges[1] - edges[0];
  // Bin centres; the open end bins drawn one bin wide.
  const centres = [edges[0] - step / 2, ...edges.slice(0, -1).map((e, i) => (e + edges[i + 1]) / 2), edges.at(-1) + step / 2];
  const labels = [`< 2^${edges[0]}`, ...edges.slice(0, -1).map((e, i) => `2^${e} … 2^${edges[i + 1]}`), `≥ 2^${edges.at(-1)}`];
  const text = payload.shares.map((row, bin) => row.map(() => labels[bin]));
  offerCsv(`histogram_${direction}_${layer}`, [
    ["log2 |value| bin", ...payload.column_steps.map((step) => `step ${step}`)],
    ...payload.shares.map((row, bin) => [labels[bin], ...row]),
  ]);
  const colors = themeColors();
  const shapes = [];
  const annotations = [];
  for (const [label, value] of Object.entries(payload.lines)) {
    if (value < centres[0] - step || value > centres.at(-1) + step) {
      annotations.push({ xref: "paper", yref: "paper", x: 1, y: value > 0 ? 1 : 0, xanchor: "right", yanchor: value > 0 ? "bottom" : "top", text: `${label} (2^${value.toFixed(1)}) is off the chart`, showarrow: false, font: { size: 10 } });
      continue;
    }
    shapes.push({ type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: value, y1: value, line: { color: colors.line, dash: label.endsWith("max") ? "solid" : "dash", width: 1.5 } });
    annotations.push({ xref: "paper", yref: "y", x: 1, y: value, xanchor: "right", yanchor: "bottom", text: `${label} (2^${value.toFixed(1)})`, showarrow: false, font: { color: colors.line, size: 11 } });
  }
  if (payload.shares.every((row) => row.every((share) => share === null))) {
    annotations.push({ xref: "paper", yref: "paper", x: 0.5, y: 0.5, text: "no finite non-zero value in any sample: all were zero or non-finite (see the Numerics view)", showarrow: false, bgcolor: colors.paper });
  }
  await plot(plotly, chart, [
    {
      type: "heatmap",
      x: payload.column_steps,
      y: centres,
      z: payload.shares,
      text,
      colorscale: "Viridis",
      zmin: 0,
      colorbar: { title: { text: "share of values", side: "right" }, tickformat: ".0%" },
      hoverongaps: false,
      hovertemplate: "step %{x}<br>|value| in %{text}<br>%{z:.1%} of the values<extra></extra>",
    },
  ], {
    title: { text: `${plotlyText(layer)}: log2 |value| histogram of the ${direction === "forward" ? "activations" : "gradients"} (${payload.dtype})`, font: { size: 14 } },
    xaxis: stepAxis(payload.column_steps),
    yaxis: { title: { text: "log2 |value| (binade)" }, zeroline: false },
    plot_bgcolor: colors.noData,
    shapes,
    annotations,
    height: 520,
    margin: { t: 50, r: 20, b: 50 },
  });
}
