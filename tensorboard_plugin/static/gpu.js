// GPU tracks of the compared runs: tensor utilization with its source named
// (GPM: Tensor Core activity measured by NVML; basic: only "a kernel ran";
// kernel share: Tensor Core share of kernel time from an XProf trace).
// Without GPU data in any run: one line, and what to do.

import { getJson } from "./api.js";
import { plot, runColor } from "./charts.js";
import { el, formatNumber, notMeasured, plotlyText } from "./dom.js";

const SOURCE_TEXT = {
  GPM: "GPM (NVML GPU performance monitoring: Tensor Core activity)",
  basic: "basic (NVML utilization: share of time any kernel ran; Tensor Core use not measured)",
  "kernel share": "kernel share (XProf trace: share of GPU kernel time in Tensor Core kernels)",
};
const PERCENT_TRACKS = ["sm_util", "sm_occupancy", "dram_bw_util", "fp16_util", "fp32_util", "gpu_util", "mem_util"];
const SNIPPET = `# Train on a machine with an NVIDIA GPU and its driver; mpprof samples it
# through NVML (pip install nvidia-ml-py) every gpu_interval seconds:
profiler = mpprof.MixedPrecisionProfiler(log_dir, gpu_interval=0.5)
model.fit(x, y, callbacks=[profiler])`;

export async function show(container, { plotly, compared, focus, runIndex, offerCsv }) {
  const payloads = await Promise.all(compared.map(async (run) => [run.run, await getJson("gpu", { run: run.run })]));
  offerCsv("gpu_samples", gpuRows(payloads));
  if (!payloads.some(([, payload]) => payload.available)) {
    const reasons = [...new Set(payloads.map(([, payload]) => payload.reason).filter(Boolean))];
    container.append(
      el("p", { class: "not-measured gpu-none" },
        `No GPU was sampled in ${payloads.length === 1 ? "this run" : `any of the ${payloads.length} compared runs`}`,
        reasons.length ? ` (${reasons.join("; ")})` : "", "."),
      el("p", {}, "To see Tensor Core use, SM activity, memory and power here:"),
      el("pre", { class: "snippet" }, SNIPPET),
    );
    return;
  }
  const tensorTraces = [];
  for (const [run, payload] of payloads) {
    container.append(runNote(run, payload));
    if (payload.available) tensorTraces.push(...tensorTracesOf(run, payload, runColor(runIndex(run))));
  }
  if (tensorTraces.length) {
    const chart = el("div", { class: "chart gpu-chart" });
    container.append(chart);
    // The legend names the run and device even when there is one trace.
    await plot(plotly, chart, tensorTraces, { ...layout("Tensor utilization (%)"), showlegend: true });
  }
  const focusPayload = payloads.find(([run]) => run === focus)?.[1];
  if (focusPayload?.available) {
    const traces = otherTracesOf(focusPayload);
    if (traces.length) {
      const chart = el("div", { class: "chart gpu-chart" });
      container.append(chart);
      await plot(plotly, chart, traces, layout(`${plotlyText(focus)}: other GPU utilizations (%)`));
    }
  }
}

/** Every sampled track of every run and device, one row per sample. */
function gpuRows(payloads) {
  const rows = [];
  for (const [run, payload] of payloads) {
    for (const [device, track] of Object.entries(payload.tracks || {})) {
      const columns = Object.keys(track);
      if (!rows.length) rows.push(["run", "device", ...columns]);
      track.wall_time.forEach((_, i) => rows.push([run, device, ...columns.map((c) => track[c][i])]));
    }
  }
  return rows.length ? rows : [["run", "GPU"], ...payloads.map(([run, payload]) => [run, payload.reason ?? "not measured"])];
}

function runNote(run, payload) {
  if (!payload.available) return notMeasured(`GPU of ${run}`, payload.reason);
  const share = payload.kernels?.tensor_core_share;
  return el(
    "div",
    { class: "gpu-note" },
    el("p", {}, el("span", { class: "run-name" }, run), `: mode ${payload.mode}`, payload.reason ? ` (${payload.reason})` : ""),
    el("p", { class: "tensor-source" }, "Tensor utilization source: ", SOURCE_TEXT[payload.tensor_source] ?? "not measured"),
    share === null || share === undefined
      ? null
      : el("p", {}, `Tensor Core share of GPU kernel time: ${formatNumber(100 * share)}%`),
  );
}

function tensorTracesOf(run, payload, color) {
  // GPM measures Tensor Core activity; "basic" has only the busy share.
  const column = payload.mode === "gpm" ? "tensor_util" : "gpu_util";
  return Object.entries(payload.tracks).map(([device, track]) => ({
    ...series(`${run} GPU:${device} ${column}`, track, column),
    line: { color },
  }));
}

function otherTracesOf(payload) {
  const traces = [];
  for (const [device, track] of Object.entries(payload.tracks)) {
    for (const column of PERCENT_TRACKS) {
      if (track[column]?.some((v) => v !== null)) traces.push(series(`GPU:${device} ${column}`, track, column));
    }
  }
  return traces;
}

function series(label, track, column) {
  const start = track.wall_time.find((t) => t !== null) ?? 0;
  return {
    name: plotlyText(label),
    x: track.wall_time.map((t) => (t === null ? null : t - start)),
    y: track[column],
    customdata: track.step,
    mode: "lines",
    hovertemplate: `${plotlyText(label)}<br>%{x:.1f} s, step %{customdata}<br>%{y:.1f}%<extra></extra>`,
  };
}

function layout(title) {
  return {
    title: { text: title },
    xaxis: { title: { text: "seconds since the first sample" } },
    yaxis: { range: [0, 100], title: { text: "percent" } },
    height: 340,
    margin: { t: 40, r: 20, b: 50 },
    legend: { orientation: "h", y: -0.25 },
  };
}
