// Loss-scale timeline (log scale) of every compared run, with a marker at
// each overflow (skipped step) and growth.

import { getJson } from "./api.js";
import { el, formatNumber, notMeasured, plotlyText } from "./dom.js";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"];

export async function show(container, { plotly, compared, target }) {
  const payloads = await Promise.all(
    compared.map(async (run) => [run.run, await getJson("loss_scale", { run: run.run, points: 2000 })]),
  );
  const traces = [];
  const notes = [];
  payloads.forEach(([run, payload], i) => {
    if (!payload.available) {
      notes.push(notMeasured(`Loss scale of ${run}`, payload.reason));
      return;
    }
    traces.push(...tracesOf(run, payload, COLORS[i % COLORS.length]));
    notes.push(summary(run, payload));
  });
  container.append(el("div", { class: "notes" }, notes));
  if (!traces.length) return;
  const chart = el("div", { class: "chart loss-scale-chart" });
  container.append(chart);
  const shapes = Number.isInteger(target.step)
    ? [{ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: "#d62728", dash: "dot" } }]
    : [];
  await plotly.newPlot(
    chart,
    traces,
    {
      title: { text: "Dynamic loss scale" },
      xaxis: { title: { text: "step" } },
      yaxis: { title: { text: "loss scale" }, type: "log", exponentformat: "power" },
      shapes,
      height: 460,
      margin: { t: 40, r: 20, b: 50, l: 70 },
      legend: { orientation: "h", y: -0.2 },
    },
    { responsive: true, displaylogo: false },
  );
}

function tracesOf(run, payload, color) {
  const name = plotlyText(run);
  const traces = [
    {
      name: `${name} scale`,
      x: payload.series.step,
      y: payload.series.scale,
      mode: "lines",
      line: { shape: "hv", color },
      hovertemplate: `${name}<br>step %{x}<br>scale %{y:.4g}<extra></extra>`,
    },
  ];
  if (payload.overflows.step.length) {
    traces.push({
      name: `${name} overflow (${payload.overflows.total})`,
      x: payload.overflows.step,
      y: payload.overflows.scale_before,
      customdata: payload.overflows.scale_after,
      mode: "markers",
      marker: { symbol: "x", size: 8, color: "#d62728", line: { color } },
      hovertemplate: `${name}<br>overflow at step %{x}: step skipped<br>scale %{y:.4g} → %{customdata:.4g}<extra></extra>`,
    });
  }
  if (payload.growths.step.length) {
    traces.push({
      name: `${name} growth (${payload.growths.total})`,
      x: payload.growths.step,
      y: payload.growths.scale_after,
      mode: "markers",
      marker: { symbol: "triangle-up", size: 7, color },
      hovertemplate: `${name}<br>growth at step %{x}<br>scale → %{y:.4g}<extra></extra>`,
    });
  }
  return traces;
}

function summary(run, payload) {
  const thinned = payload.overflows.total > payload.overflows.step.length
    ? ` (${payload.overflows.step.length} markers shown)` : "";
  return el(
    "p",
    { class: "loss-scale-summary" },
    el("span", { class: "run-name" }, run),
    `: scale ${formatNumber(payload.initial_scale)} → ${formatNumber(payload.final_scale)} over ${formatNumber(payload.steps_run - payload.first_step)} steps; `,
    `${formatNumber(payload.overflows.total)} overflows${thinned}, ${formatNumber(payload.growths.total)} growths`,
    payload.steps_since_last_overflow === null ? "" : `; last overflow ${formatNumber(payload.steps_since_last_overflow)} steps ago`,
  );
}
