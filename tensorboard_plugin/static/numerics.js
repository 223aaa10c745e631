// Per-layer numerics of the focus run: layer x step heatmaps (forward
// headroom before the run's dtype overflows, gradient underflow), downsampled
// by the server to the chart's width; a click shows one layer's history.
// Thresholds and labels follow the dtype the layers computed in: float16's
// underflow shares say nothing about a bfloat16 run.

import { getJson } from "./api.js";
import { plot, stepAxis, themeColors } from "./charts.js";
import { el, formatNumber, notMeasured, plotlyText, replace } from "./dom.js";

const SECOND_HEATMAPS = [
  ["backward", "underflow_frac", "gradient underflow", "share of non-zero gradient values below float16's smallest normal"],
  ["backward", "zero_frac", "gradient zeros", "share of gradient values that are exactly 0"],
  ["backward", "subnormal_frac", "gradient subnormals", "share of gradient values below float16's smallest subnormal"],
  ["backward", "nonfinite_frac", "gradient non-finite values", "share of gradient values that are inf or NaN"],
  ["forward", "nonfinite_frac", "activation non-finite values", "share of output values that are inf or NaN"],
  ["forward", "zero_frac", "activation zeros", "share of output values that are exactly 0"],
];
// Judged against float16's range whatever the run computed in.
const FLOAT16_SHARES = new Set(["underflow_frac", "subnormal_frac"]);
// The same colours as the HTML report's headroom heatmaps (report.js).
const HEADROOM_COLORS = [[0, "#b2182b"], [0.1, "#ef8a62"], [0.35, "#fddbc7"], [0.6, "#d1e5f0"], [1, "#2166ac"]];
const SHARE_COLORS = [[0, "#f7f7f7"], [1, "#54278f"]];
const NEUTRAL_COLORS = [[0, "#f7f7f7"], [1, "#737373"]];

export async function show(container, context) {
  const { focus, target } = context;
  const columns = Math.max(50, Math.min(2000, Math.round(container.clientWidth || 1000)));
  const headroom = await getJson("numerics", { run: focus, direction: "forward", stat: "headroom", columns });
  if (!headroom.available) {
    container.append(notMeasured("Per-layer numerics", headroom.reason));
    return;
  }
  const history = el("div", { class: "layer-history" });
  const openLayer = (layer) => {
    context.setLayer(layer);
    return showHistory(history, context, layer);
  };
  const first = el("div", { class: "chart heatmap headroom" });
  const secondChart = el("div", { class: "chart heatmap second" });
  const chooser = el(
    "select",
    { "aria-label": "second heatmap", onchange: (e) => drawSecond(Number(e.target.value)) },
    SECOND_HEATMAPS.map(([, , label], i) => el("option", { value: String(i) }, label)),
  );
  container.append(
    el("p", { class: "hint" }, hint(headroom, target)),
    first,
    el("label", { class: "chooser" }, "Second heatmap: ", chooser),
    secondChart,
    history,
  );
  const dtype = headroom.dtype;
  context.offerCsv("headroom_bits", [
    ["layer", ...headroom.column_steps.map((step) => `step ${step}`)],
    ...headroom.rows.map((row, i) => [row, ...headroom.values[i]]),
  ]);
  await heatmap(context, first, headroom, {
    title: `Forward headroom: bits left below ${dtype}'s largest value ${formatNumber(headroom.policy_max, 5)} (red: little left; below 0: overflowed)`,
    colorbar: "bits of headroom",
    colorscale: HEADROOM_COLORS,
    zmin: -1,
    zmax: headroom.headroom_color_max, // plenty in any dtype: the colours saturate
    cellText: (value, row, column) => {
      if (headroom.overflowed[row][column]) {
        const share = headroom.nonfinite[row][column];
        return share ? `overflowed: ${formatPercent(share)} non-finite` : `overflowed: beyond ${dtype}'s max`;
      }
      return `headroom ${value.toFixed(1)} bits`;
    },
  }, openLayer);
  const drawSecond = async (index) => {
    const [direction, stat, label, what] = SECOND_HEATMAPS[index];
    const payload = await getJson("numerics", { run: focus, direction, stat, columns });
    if (!payload.available) {
      replace(secondChart, notMeasured(label, payload.reason));
      return;
    }
    // bfloat16 (and float32) keep float32's exponent range: a value below
    // float16's normal range is no underflow there. Shown, not judged.
    const judged = !FLOAT16_SHARES.has(stat) || payload.underflow_applies;
    await heatmap(context, secondChart, payload, {
      title: judged ? `${label}: ${what}` : `${label}: ${what} (informative only: ${payload.dtype}'s smallest normal is 2^${Math.log2(payload.dtype_smallest_normal)}, these values do not underflow)`,
      colorbar: "share of values",
      colorscale: judged ? SHARE_COLORS : NEUTRAL_COLORS,
      zmin: 0,
      zmax: 1,
      cellText: (value) => `share ${formatPercent(value)}`,
    }, openLayer);
  };
  await drawSecond(0);
  await compareRuns(container, context, columns, history);
  const layer = target.layer && headroom.row_layers.includes(target.layer) ? target.layer : null;
  if (layer) await openLayer(layer);
  else if (Number.isInteger(target.step)) {
    // From an overflow marker: the first layer (in call order) that overflowed at that step.
    const column = nearestColumn(headroom.column_steps, target.step);
    const row = headroom.overflowed.findIndex((cells) => cells[column]);
    if (row >= 0) await openLayer(headroom.row_layers[row]);
  }
}

/** The headroom heatmaps of the other compared runs, side by side below. */
async function compareRuns(container, context, columns, before) {
  const others = context.compared.filter((run) => run.run !== context.focus && run.has_numerics);
  if (!others.length) return;
  const grid = el("div", { class: "compared-heatmaps" });
  container.insertBefore(el("h3", {}, "Compared runs: forward headroom"), before);
  container.insertBefore(grid, before);
  // Every chart in the grid first: plotly sizes a chart to its cell when drawn.
  const charts = others.map(() => el("div", { class: "chart heatmap compared" }));
  grid.append(...charts);
  for (const [i, run] of others.entries()) {
    const chart = charts[i];
    const payload = await getJson("numerics", { run: run.run, direction: "forward", stat: "headroom", columns: Math.round(columns / 2) });
    if (!payload.available) {
      replace(chart, notMeasured(`Numerics of ${run.run}`, payload.reason));
      continue;
    }
    await heatmap(context, chart, payload, {
      title: `${run.run} (${payload.dtype})`,
      colorbar: "bits of headroom",
      colorscale: HEADROOM_COLORS,
      zmin: -1,
      zmax: payload.headroom_color_max,
      cellText: (value, row, column) => (payload.overflowed[row][column] ? `overflowed: ${formatPercent(payload.nonfinite[row][column])} non-finite` : `headroom ${value.toFixed(1)} bits`),
    }, null);
  }
}

function formatPercent(share) {
  if (share === null || share === undefined) return "–";
  return `${(100 * share).toFixed(share > 0 && share < 0.001 ? 3 : 1)}%`;
}

function nearestColumn(steps, step) {
  let best = 0;
  steps.forEach((s, i) => {
    if (s <= step) best = i;
  });
  return best;
}

function hint(payload, target) {
  const perColumn = Math.ceil(payload.samples_total / Math.max(1, payload.column_steps.length));
  const forensic = payload.column_forensic.filter(Boolean).length;
  return (
    `${payload.layers_total} layers x ${payload.samples_total} sampled steps, computed in ${payload.dtype}` +
    (perColumn > 1 ? ` (${perColumn} samples per column)` : "") +
    `; each cell shows the worst value of the layers and steps it covers; grey: no sample` +
    (forensic ? `; an orange bar above a column marks the ${forensic} columns holding samples taken right after an overflow (forensic)` : "") +
    (Number.isInteger(target.step) ? `; the dashed line is step ${target.step}` : "") +
    ". Click a cell for that layer's history."
  );
}

async function heatmap(context, chart, payload, { title, colorbar, colorscale, zmin, zmax, cellText }, openLayer) {
  const { plotly, target } = context;
  const rows = payload.rows.map(plotlyText);
  const colors = themeColors();
  const text = payload.values.map((cells, row) =>
    cells.map((value, column) => (value === null ? "no sample" : cellText(value, row, column))),
  );
  const values = payload.values.flat().filter((value) => value !== null);
  const shapes = [];
  const annotations = [];
  const steps = payload.column_steps;
  const halfWidth = steps.length > 1 ? (steps[1] - steps[0]) / 2 : 0.5;
  payload.column_forensic.forEach((forensic, i) => {
    if (!forensic) return;
    shapes.push({ type: "rect", xref: "x", yref: "paper", x0: steps[i] - halfWidth, x1: steps[i] + halfWidth, y0: 1.0, y1: 1.04, fillcolor: "#f57c00", line: { width: 0 } });
  });
  if (Number.isInteger(target.step)) {
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: colors.line, dash: "dash", width: 2 } });
    annotations.push({ xref: "x", yref: "paper", x: target.step, y: 0, yanchor: "top", yshift: -2, text: `step ${target.step}`, showarrow: false, font: { color: colors.line, size: 11 } });
  }
  if (values.length && values.every((value) => value === 0)) {
    annotations.push({ xref: "paper", yref: "paper", x: 0.5, y: 0.5, text: "every sampled value is 0", showarrow: false, bgcolor: colors.paper, font: { size: 13 } });
  }
  await plot(plotly, chart, [
    {
      type: "heatmap",
      x: steps,
      y: rows,
      z: payload.values,
      text,
      colorscale,
      zmin,
      zmax,
      colorbar: { title: { text: colorbar, side: "right" } },
      hoverongaps: false,
      hovertemplate: `%{y}<br>from step %{x}<br>%{text}<extra></extra>`,
    },
  ], {
    title: { text: plotlyText(title), font: { size: 14 } },
    xaxis: stepAxis(steps),
    yaxis: { autorange: "reversed", automargin: true, type: "category", title: { text: "layer (call order)" } },
    // Cells without a sample show the background: grey, unlike a 0.
    plot_bgcolor: colors.noData,
    shapes,
    annotations,
    height: Math.min(900, 180 + 14 * rows.length),
    margin: { t: 60, r: 20, b: 50 },
  });
  if (!openLayer) return;
  chart.on("plotly_click", (event) => {
    const point = event.points[0];
    const row = Array.isArray(point.pointIndex) ? point.pointIndex[0] : rows.indexOf(point.y);
    if (row >= 0) openLayer(payload.row_layers[row]);
  });
}

async function showHistory(container, { plotly, focus, target, offerCsv }, layer) {
  replace(container, el("h3", {}, "History of layer ", el("code", { class: "layer-name" }, layer)));
  const payload = await getJson("layer_history", { run: focus, layer });
  if (!payload.available) {
    container.append(notMeasured("Layer history", payload.reason));
    return;
  }
  const name = plotlyText(layer);
  const colors = themeColors();
  const magnitudes = el("div", { class: "chart history-chart magnitudes" });
  const shares = el("div", { class: "chart history-chart shares" });
  const overflowCount = payload.overflowed.filter(Boolean).length;
  container.append(
    el("p", { class: "hint" },
      `Computed in ${payload.dtype}. `,
      overflowCount ? `× at the dtype's max: the ${overflowCount} samples whose output overflowed (their finite max says nothing). ` : "",
      "◆ samples taken right after an overflow (forensic)."),
    magnitudes,
    shares,
  );
  const steps = payload.step;
  const keys = Object.keys(payload.series);
  offerCsv(`layer_history_${layer}`, [
    ["step", "forensic", "overflowed", ...keys],
    ...steps.map((step, i) => [step, payload.forensic[i], payload.overflowed[i], ...keys.map((k) => payload.series[k][i])]),
  ]);
  // On the log axis a magnitude of 0 cannot be drawn: a gap, not a dive.
  const line = (key, label, { log = false } = {}) =>
    payload.series[key]
      ? [{ name: label, x: steps, y: log ? payload.series[key].map((v) => (v === 0 ? null : v)) : payload.series[key], mode: "lines+markers", marker: { size: 4 }, hovertemplate: `${label}<br>step %{x}<br>%{y:.4g}<extra></extra>` }]
      : [];
  const maxLine = payload.policy_max
    ? [{ name: `${payload.dtype} max`, x: [steps[0], steps.at(-1)], y: [payload.policy_max, payload.policy_max], mode: "lines", line: { dash: "dash", color: colors.line }, hoverinfo: "skip" }]
    : [];
  const picked = (mask) => steps.map((_, i) => i).filter((i) => mask[i]);
  const overflowed = picked(payload.overflowed);
  const nonfinite = payload.series["forward/nonfinite_frac"] || [];
  const overflowMarkers = overflowed.length ? [{
    name: "overflowed output",
    x: overflowed.map((i) => steps[i]),
    y: overflowed.map(() => payload.policy_max),
    text: overflowed.map((i) => (nonfinite[i] ? `${formatPercent(nonfinite[i])} non-finite` : `beyond ${payload.dtype}'s max`)),
    mode: "markers",
    marker: { symbol: "x", size: 11, color: colors.line, line: { width: 2, color: colors.line } },
    hovertemplate: "step %{x}: output overflowed<br>%{text}<extra></extra>",
  }] : [];
  const forensic = picked(payload.forensic);
  const activation = payload.series["forward/abs_max"] || [];
  const forensicMarkers = forensic.length ? [{
    name: "forensic sample",
    x: forensic.map((i) => steps[i]),
    y: forensic.map((i) => (payload.overflowed[i] ? payload.policy_max : activation[i] || null)),
    mode: "markers",
    marker: { symbol: "diamond-open", size: 10, color: "#f57c00", line: { width: 2 } },
    hovertemplate: "step %{x}: sampled right after an overflow<extra></extra>",
  }] : [];
  const targetLine = Number.isInteger(target.step)
    ? [{ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: colors.line, dash: "dot" } }]
    : [];
  await plot(plotly, magnitudes,
    [...line("forward/abs_max", "activation abs max", { log: true }), ...line("backward/abs_max", "gradient abs max (scaled)", { log: true }), ...maxLine, ...overflowMarkers, ...forensicMarkers],
    { title: { text: `${name}: largest finite magnitude per sample` }, yaxis: { type: "log", exponentformat: "power", title: { text: "|value| (log)" } }, xaxis: stepAxis(steps), shapes: targetLine, height: 340, margin: { t: 40, r: 20, b: 50 } },
  );
  const underflowLabel = payload.underflow_applies ? "gradient underflow" : "gradient below float16's normal range (no underflow in " + payload.dtype + ")";
  await plot(plotly, shares,
    [
      ...line("backward/underflow_frac", underflowLabel),
      ...line("backward/zero_frac", "gradient zeros"),
      ...line("backward/nonfinite_frac", "gradient non-finite"),
      ...line("forward/nonfinite_frac", "activation non-finite"),
      ...line("forward/zero_frac", "activation zeros"),
    ],
    { title: { text: `${name}: shares of values per sample` }, yaxis: { range: [0, 1.02], title: { text: "share of values" }, tickformat: ".0%" }, xaxis: stepAxis(steps), shapes: targetLine, height: 340, margin: { t: 40, r: 20, b: 50 } },
  );
  container.scrollIntoView({ block: "nearest" });
}
