// Loss-scale timeline (log scale) of every compared run in its run colour,
// a marker at each overflow (skipped step: a click opens the numerics at
// that step) and growth, and a reference line at scale 1.

import { getJson } from "./api.js";
import { plot, runColor, stepAxis, themeColors } from "./charts.js";
import { el, formatNumber, notMeasured, plotlyText } from "./dom.js";

export async function show(container, { plotly, compared, target, navigate, runIndex, offerCsv }) {
  const payloads = await Promise.all(
    compared.map(async (run) => [run.run, await getJson("loss_scale", { run: run.run, points: 2000 })]),
  );
  const traces = [];
  const notes = [];
  const csv = [["run", "step", "loss scale"]];
  for (const [run, payload] of payloads) {
    if (!payload.available) {
      notes.push(notMeasured(`Loss scale of ${run}`, payload.reason));
      continue;
    }
    traces.push(...tracesOf(run, payload, runColor(runIndex(run))));
    notes.push(summary(run, payload));
    payload.series.step.forEach((step, i) => csv.push([run, step, payload.series.scale[i]]));
  }
  offerCsv("loss_scale", csv);
  container.append(el("div", { class: "notes" }, notes));
  if (!traces.length) return;
  container.append(
    el("p", { class: "hint" }, "× an overflow (the step was skipped and the scale halved; click it for the numerics at that step), ▲ a growth. Below the dotted line at 1 the loss is scaled down: gradients overflow even unscaled."),
  );
  const chart = el("div", { class: "chart loss-scale-chart" });
  container.append(chart);
  const colors = themeColors();
  const shapes = [
    { type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: 1, y1: 1, line: { color: colors.text, dash: "dot", width: 1 } },
  ];
  const annotations = [
    { xref: "paper", yref: "y", x: 1, y: 0, yanchor: "bottom", xanchor: "right", text: "scale 1", showarrow: false, font: { size: 11 } },
  ];
  if (Number.isInteger(target.step)) {
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: target.step, x1: target.step, y0: 0, y1: 1, line: { color: colors.line, dash: "dash" } });
    annotations.push({ xref: "x", yref: "paper", x: target.step, y: 1, yanchor: "bottom", text: `finding at step ${target.step}`, showarrow: false, font: { color: colors.line } });
  }
  await plot(plotly, chart, traces, {
    title: { text: "Dynamic loss scale per run" },
    xaxis: stepAxis(traces[0].x),
    yaxis: { title: { text: "loss scale (log)" }, type: "log", exponentformat: "power" },
    shapes,
    annotations,
    height: 460,
    margin: { t: 50, r: 20, b: 50, l: 70 },
    legend: { orientation: "h", y: -0.2 },
  });
  chart.on("plotly_click", (event) => {
    const point = event.points.find((p) => p.data.meta?.kind === "overflow");
    if (point) navigate("numerics", { step: point.x });
  });
}

function tracesOf(run, payload, color) {
  const name = plotlyText(run);
  const traces = [
    {
      name: `${name} scale`,
      legendgroup: name,
      x: payload.series.step,
      y: payload.series.scale,
      mode: "lines",
      line: { shape: "hv", color, width: 2 },
      hovertemplate: `${name}<br>step %{x}<br>scale %{y:.4g}<extra></extra>`,
    },
  ];
  if (payload.overflows.step.length) {
    traces.push({
      name: `${name} overflow (${payload.overflows.total})`,
      legendgroup: name,
      meta: { kind: "overflow" },
      x: payload.overflows.step,
      y: payload.overflows.scale_before,
      customdata: payload.overflows.scale_after,
      mode: "markers",
      // Thin open crosses in the run's colour: many of them leave its line visible.
      marker: { symbol: "x-thin-open", size: 7, color, line: { color, width: 1.5 } },
      hovertemplate: `${name}<br>overflow at step %{x}: step skipped<br>scale %{y:.4g} → %{customdata:.4g}<br>click: numerics at this step<extra></extra>`,
    });
  }
  if (payload.growths.step.length) {
    traces.push({
      name: `${name} growth (${payload.growths.total})`,
      legendgroup: name,
      x: payload.growths.step,
      y: payload.growths.scale_after,
      mode: "markers",
      marker: { symbol: "triangle-up-open", size: 6, color },
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
