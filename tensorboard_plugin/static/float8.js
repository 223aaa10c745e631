// Float8 view of the focus run: Keras' float8 layers (model.quantize("float8"))
// with delayed scaling. Heatmaps of the share of each layer's tensor that
// saturated (clipped at the format's max) and of its non-zero values that
// quantized to zero, measured on sampled steps; then one layer's scales and
// amax over the run (a click on a heatmap row, or a finding, picks it).

import { getJson } from "./api.js";
import { plot, stepAxis, themeColors } from "./charts.js";
import { el, formatNumber, notMeasured, plotlyText, replace } from "./dom.js";

const SHARE_COLORS = [[0, "#f7f7f7"], [1, "#b2182b"]];
const UNDERFLOW_COLORS = [[0, "#f7f7f7"], [1, "#54278f"]];
const TENSOR_TITLES = { inputs: "inputs", kernel: "kernel", outputs_grad: "output gradient" };

export async function show(container, context) {
  const { focus, target } = context;
  const columns = Math.max(50, Math.min(2000, Math.round(container.clientWidth || 1000)));
  const payload = await getJson("float8", { run: focus, columns, layer: target.layer || undefined });
  if (!payload.available) {
    container.append(notMeasured("Float8 training", payload.reason));
    return;
  }
  const shares = payload.shares;
  const history = el("div", { class: "float8-history" });
  const openLayer = async (layer) => {
    context.setLayer(layer);
    const next = layer === payload.layer ? payload : await getJson("float8", { run: focus, columns, layer });
    await showHistory(history, context, next);
  };
  container.append(
    el("p", { class: "hint float8-summary" },
      `${payload.layers.length} float8 layers (${[...new Set(payload.policies)].join(", ")}); `,
      `inputs and kernel in ${payload.formats.inputs} (max ${formatNumber(payload.format_max.inputs)}), `,
      `output gradient in ${payload.formats.outputs_grad} (max ${formatNumber(payload.format_max.outputs_grad)}). `,
      "Keras quantizes x / scale, the scale set from the amax history up to two steps before (delayed scaling)."),
  );
  context.offerCsv("float8_saturated_share", [
    ["layer · tensor", ...shares.column_steps.map((step) => `step ${step}`)],
    ...shares.rows.map((row, i) => [row, ...shares.values.saturated[i]]),
  ]);
  if (!shares.samples_total) {
    container.append(notMeasured("Saturation and underflow shares", "no step was sampled (numerics_every=None, or the run is shorter than numerics_every)"));
  } else {
    const saturated = el("div", { class: "chart heatmap float8-saturated" });
    const underflowed = el("div", { class: "chart heatmap float8-underflowed" });
    container.append(
      el("p", { class: "hint" }, `${shares.rows.length} rows x ${shares.samples_total} sampled steps; each cell the worst share of the steps it covers; grey: not measured. Click a row for that layer's scales.`),
      saturated,
      underflowed,
    );
    await heatmap(context, saturated, shares, shares.values.saturated, {
      title: "Saturation: share of the tensor's values beyond the format's max (clipped)",
      colorscale: SHARE_COLORS,
    }, openLayer);
    await heatmap(context, underflowed, shares, shares.values.underflowed, {
      title: "Underflow: share of the tensor's non-zero values that quantize to zero",
      colorscale: UNDERFLOW_COLORS,
    }, openLayer);
  }
  const chooser = el(
    "select",
    { "aria-label": "float8 layer", class: "float8-layer", onchange: (e) => openLayer(e.target.value) },
    payload.layers.map((layer) => el("option", { value: layer, selected: layer === payload.layer }, layer)),
  );
  container.append(el("label", { class: "chooser" }, "Layer: ", chooser), history);
  await showHistory(history, context, payload);
}

function formatPercent(share) {
  if (share === null || share === undefined) return "–";
  return `${(100 * share).toFixed(share > 0 && share < 0.001 ? 3 : 1)}%`;
}

async function heatmap(context, chart, shares, values, { title, colorscale }, openLayer) {
  const { plotly, target } = context;
  const rows = shares.rows.map(plotlyText);
  const colors = themeColors();
  const steps = shares.column_steps;
  const shapes = [];
  if (Number.isInteger(target.step)) {
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: colors.line, dash: "dash", width: 2 } });
  }
  await plot(plotly, chart, [
    {
      type: "heatmap",
      x: steps,
      y: rows,
      z: values,
      text: values.map((cells) => cells.map((value) => (value === null ? "not measured" : formatPercent(value)))),
      colorscale,
      zmin: 0,
      zmax: 1,
      colorbar: { title: { text: "share", side: "right" }, tickformat: ".0%" },
      hoverongaps: false,
      hovertemplate: "%{y}<br>from step %{x}<br>%{text}<extra></extra>",
    },
  ], {
    title: { text: plotlyText(title), font: { size: 14 } },
    xaxis: stepAxis(steps),
    yaxis: { autorange: "reversed", automargin: true, type: "category" },
    plot_bgcolor: colors.noData,
    shapes,
    height: Math.min(900, 180 + 16 * rows.length),
    margin: { t: 60, r: 20, b: 50 },
  });
  chart.on("plotly_click", (event) => {
    const point = event.points[0];
    const row = Array.isArray(point.pointIndex) ? point.pointIndex[0] : rows.indexOf(point.y);
    if (row >= 0) openLayer(shares.row_layers[row]);
  });
}

async function showHistory(container, { plotly, target, offerCsv }, payload) {
  const layer = payload.layer;
  replace(container, el("h3", {}, "Delayed scaling of float8 layer ", el("code", { class: "layer-name" }, layer)));
  const { steps, tensors } = payload.history;
  if (!steps.length) {
    container.append(notMeasured("Scales and amax", "no flush recorded the float8 state yet"));
    return;
  }
  container.append(el("p", { class: "hint" }, "Per tensor: its latest amax and its amax history's largest at each flush, and the largest value its scale represents (scale x the format's max): an amax above that line was clipped."));
  const name = plotlyText(layer);
  const colors = themeColors();
  const targetLine = Number.isInteger(target.step)
    ? [{ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: colors.line, dash: "dot" } }]
    : [];
  const csv = [["tensor", "step", "scale", "amax_last", "amax_max"]];
  for (const [tensor, lines] of Object.entries(tensors)) {
    steps.forEach((step, i) => csv.push([tensor, step, lines.scale[i], lines.amax_last[i], lines.amax_max[i]]));
    const chart = el("div", { class: `chart history-chart float8-${tensor}` });
    container.append(chart);
    const label = `${TENSOR_TITLES[tensor] || tensor} (${payload.formats[tensor] || "?"})`;
    const line = (key, text, style = {}) => ({
      name: text,
      x: steps,
      // A magnitude of 0 cannot sit on a log axis: a gap.
      y: lines[key].map((v) => (v === 0 ? null : v)),
      mode: "lines+markers",
      marker: { size: 4 },
      line: style,
      hovertemplate: `${text}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
    });
    await plot(plotly, chart, [
      line("amax_last", "latest amax"),
      line("amax_max", "amax history max", { dash: "dot" }),
      line("scale_range", "scale x format max", { dash: "dash", color: colors.line }),
    ], {
      title: { text: `${name}: ${plotlyText(label)}` },
      xaxis: stepAxis(steps),
      yaxis: { type: "log", exponentformat: "power", title: { text: "|value| (log)" } },
      shapes: targetLine,
      height: 300,
      margin: { t: 40, r: 20, b: 50 },
    });
  }
  offerCsv(`float8_${layer}`, csv);
}
