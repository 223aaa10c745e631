// Per-layer numerics of the focus run: layer x step heatmaps (forward
// headroom before the dtype overflows, gradient underflow), downsampled by
// the server to the chart's width; a click shows one layer's history.

import { getJson } from "./api.js";
import { el, notMeasured, plotlyText, replace } from "./dom.js";

const SECOND_HEATMAPS = [
  ["backward", "underflow_frac", "gradient underflow (share of values flushed to zero or subnormal)"],
  ["backward", "zero_frac", "gradient zeros (share)"],
  ["backward", "subnormal_frac", "gradient subnormals (share)"],
  ["backward", "nonfinite_frac", "gradient non-finite values (share)"],
  ["forward", "nonfinite_frac", "activation non-finite values (share)"],
  ["forward", "zero_frac", "activation zeros (share)"],
];
const HEADROOM_COLORS = [[0, "#b2182b"], [0.1, "#ef8a62"], [0.35, "#fddbc7"], [0.6, "#d1e5f0"], [1, "#2166ac"]];

export async function show(container, context) {
  const { focus, target } = context;
  const columns = Math.max(50, Math.min(2000, Math.round(container.clientWidth || 1000)));
  const headroom = await getJson("numerics", { run: focus, direction: "forward", stat: "headroom", columns });
  if (!headroom.available) {
    container.append(notMeasured("Per-layer numerics", headroom.reason));
    return;
  }
  const history = el("div", { class: "layer-history" });
  const openLayer = (layer) => showHistory(history, context, layer);
  const first = el("div", { class: "chart heatmap" });
  const secondChart = el("div", { class: "chart heatmap" });
  const chooser = el(
    "select",
    { "aria-label": "second heatmap", onchange: (e) => drawSecond(Number(e.target.value)) },
    SECOND_HEATMAPS.map(([, , label], i) => el("option", { value: String(i) }, label)),
  );
  container.append(
    el("p", { class: "hint" }, hint(headroom)),
    first,
    el("label", { class: "chooser" }, "Second heatmap: ", chooser),
    secondChart,
    history,
  );
  await heatmap(context.plotly, first, headroom, {
    title: `Forward headroom: bits left below the largest ${headroom.policy_max ? headroom.policy_max.toPrecision(5) : ""} (below 0: overflowed)`,
    colorscale: HEADROOM_COLORS,
    zmin: -1,
    zmax: 16,
    valueLabel: "headroom %{z:.1f} bits",
  }, openLayer);
  const drawSecond = async (index) => {
    const [direction, stat, label] = SECOND_HEATMAPS[index];
    const payload = await getJson("numerics", { run: focus, direction, stat, columns });
    if (!payload.available) {
      replace(secondChart, notMeasured(label, payload.reason));
      return;
    }
    await heatmap(context.plotly, secondChart, payload, {
      title: label,
      colorscale: [[0, "#f7f7f7"], [1, "#54278f"]],
      zmin: 0,
      zmax: 1,
      valueLabel: "share %{z:.3f}",
    }, openLayer);
  };
  await drawSecond(0);
  if (target.layer) await openLayer(target.layer);
}

function hint(payload) {
  const perColumn = Math.ceil(payload.samples_total / Math.max(1, payload.column_steps.length));
  const forensic = payload.column_forensic.filter(Boolean).length;
  return (
    `${payload.layers_total} layers x ${payload.samples_total} sampled steps` +
    (perColumn > 1 ? ` (${perColumn} samples per column)` : "") +
    `; each cell shows the worst value of the layers and steps it covers` +
    (forensic ? `; ${forensic} columns hold samples taken right after an overflow` : "") +
    ". Click a cell for that layer's history."
  );
}

async function heatmap(plotly, chart, payload, { title, colorscale, zmin, zmax, valueLabel }, openLayer) {
  const rows = payload.rows.map(plotlyText);
  await plotly.newPlot(
    chart,
    [
      {
        type: "heatmap",
        x: payload.column_steps,
        y: rows,
        z: payload.values,
        colorscale,
        zmin,
        zmax,
        hoverongaps: false,
        hovertemplate: `%{y}<br>from step %{x}<br>${valueLabel}<extra></extra>`,
      },
    ],
    {
      title: { text: plotlyText(title) },
      xaxis: { title: { text: "step" } },
      yaxis: { autorange: "reversed", automargin: true, type: "category" },
      height: Math.min(900, 160 + 14 * rows.length),
      margin: { t: 40, r: 20, b: 50 },
    },
    { responsive: true, displaylogo: false },
  );
  chart.on("plotly_click", (event) => {
    const point = event.points[0];
    const row = Array.isArray(point.pointIndex) ? point.pointIndex[0] : rows.indexOf(point.y);
    if (row >= 0) openLayer(payload.row_layers[row]);
  });
}

async function showHistory(container, { plotly, focus }, layer) {
  replace(container, el("h3", {}, "History of layer ", el("code", { class: "layer-name" }, layer)));
  const payload = await getJson("layer_history", { run: focus, layer });
  if (!payload.available) {
    container.append(notMeasured("Layer history", payload.reason));
    return;
  }
  const name = plotlyText(layer);
  const magnitudes = el("div", { class: "chart history-chart" });
  const shares = el("div", { class: "chart history-chart" });
  container.append(magnitudes, shares);
  const line = (key, label, extra = {}) =>
    payload.series[key] ? [{ name: label, x: payload.step, y: payload.series[key], mode: "lines+markers", marker: { size: 4 }, ...extra }] : [];
  const maxLine = payload.policy_max
    ? [{ name: "dtype max", x: [payload.step[0], payload.step.at(-1)], y: [payload.policy_max, payload.policy_max], mode: "lines", line: { dash: "dash", color: "#d62728" } }]
    : [];
  await plotly.newPlot(
    magnitudes,
    [...line("forward/abs_max", "activation abs max"), ...line("backward/abs_max", "gradient abs max"), ...maxLine],
    { title: { text: `${name}: magnitudes` }, yaxis: { type: "log", exponentformat: "power" }, xaxis: { title: { text: "step" } }, height: 320, margin: { t: 40, r: 20, b: 50 } },
    { responsive: true, displaylogo: false },
  );
  await plotly.newPlot(
    shares,
    [
      ...line("backward/underflow_frac", "gradient underflow"),
      ...line("backward/zero_frac", "gradient zeros"),
      ...line("backward/nonfinite_frac", "gradient non-finite"),
      ...line("forward/nonfinite_frac", "activation non-finite"),
      ...line("forward/zero_frac", "activation zeros"),
    ],
    { title: { text: `${name}: shares of values` }, yaxis: { range: [0, 1] }, xaxis: { title: { text: "step" } }, height: 320, margin: { t: 40, r: 20, b: 50 } },
    { responsive: true, displaylogo: false },
  );
  container.scrollIntoView({ block: "nearest" });
}
