// Precision advice for the focus run (mpprof advise): the plan in three
// parts (must be float32, can go lower, float8 candidates) with each layer's
// evidence, the code to paste, the projected speed on a GPU with its
// assumptions, and whether the plan was verified on the run's own batches.
// All text goes in as text nodes (el), never as markup.

import { getJson } from "./api.js";
import { el, notMeasured } from "./dom.js";

// How an attention layer's sizing reason starts (mpprof.advisor.plan.ATTENTION_EVIDENCE).
const ATTENTION_EVIDENCE = "attention GEMMs per step";

const ACTIONS = {
  float32: "must be float32",
  lower: "can go lower",
  float8: "float8 candidate",
  keep: "stays",
};

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value >= 1e-3 ? `${(value * 1e3).toPrecision(3)} ms` : `${(value * 1e6).toPrecision(3)} µs`;
}

export async function show(container, { focus, offerCsv }) {
  const payload = await getJson("advice", { run: focus });
  if (!payload.available) {
    container.append(notMeasured("Precision advice", payload.reason));
    return;
  }
  const { plan, projection, baseline } = payload;
  container.append(
    el("p", { class: "hint advice-baseline" },
      `Policy now: ${plan.model_policy}. Float32 matmuls: ${baseline.float32_matmuls.setting ?? "not recorded"} `,
      `(on ${projection.gpu}: ${String(baseline.float32_runs_as).toUpperCase()}).`),
    ...payload.notes.map((note) => el("p", { class: "hint advice-note" }, note)),
  );
  if (plan.nothing_to_change) {
    container.append(el("p", { class: "advice-nothing" }, "Nothing to change: the data support the current policies."));
  }
  const rows = plan.rows.filter((row) => row.action !== "keep" || row.planned === "float32");
  offerCsv("advice", [
    ["layer", "class", "now", "plan", "action", "why"],
    ...plan.rows.map((row) => [row.layer, row.cls, row.now, row.planned, row.action, row.reasons.join("; ")]),
  ]);
  if (rows.length) {
    container.append(
      el("table", { class: "advice" },
        el("thead", {}, el("tr", {}, ["layer", "class", "now", "plan", "why (evidence)"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows.map((row) =>
          el("tr", { class: `advice-${row.action}` },
            el("td", {}, row.layer),
            el("td", {}, row.cls),
            el("td", {}, row.now),
            el("td", {}, `${row.planned} (${ACTIONS[row.action] ?? row.action})`),
            el("td", {}, row.reasons.join("; ")),
          )))),
    );
  }
  // Each attention layer's sizing (its QK^T and AV products, their FLOPs and
  // alignment), shown though its row does not change.
  const attention = plan.rows.flatMap((row) => row.reasons
    .filter((reason) => reason.startsWith(ATTENTION_EVIDENCE))
    .map((reason) => `${row.layer} (${row.cls}): ${reason}`));
  if (attention.length) {
    container.append(
      el("p", { class: "advice-attention" }, "Attention (sized from the recorded shapes):"),
      el("ul", { class: "advice-attention" }, attention.map((line) => el("li", {}, line))),
    );
  }
  if (!plan.nothing_to_change) container.append(el("pre", { class: "advice-code" }, plan.code));
  const speedup = projection.gemm_speedup ? ` (${projection.gemm_speedup.toFixed(2)}x)` : "";
  container.append(
    el("p", { class: "advice-projection" },
      `Projection on ${projection.gpu_full_name}: GEMMs and casts ${seconds(projection.gemm_seconds_now)} per step now, `,
      `${seconds(projection.gemm_seconds_plan)} with the plan${speedup}. `,
      projection.step_speedup
        ? `Whole step: ${projection.step_speedup.toFixed(2)}x (Amdahl, the GEMMs' share from ${projection.amdahl_detail}). `
        : `${projection.step_note ?? ""} `,
      "A roofline projection (78% of peak compute, 92% of peak bandwidth), not a measurement; ",
      "mpprof advise LOGDIR --gpu NAME projects for another GPU."),
    el("p", { class: "advice-verification" },
      `Verification: ${payload.verification?.detail ?? "unverified"}`),
  );
}
