// Overview: the compared runs side by side, then the focus run's findings,
// most severe first, each linking to the view that holds its evidence.

import { getJson } from "./api.js";
import { el, formatNumber, notMeasured } from "./dom.js";

// Which view shows the evidence of each finding code (see the README's
// finding catalogue).
const EVIDENCE_VIEW = {
  MP001: "loss_scale",
  MP002: "loss_scale",
  MP003: "numerics",
  MP004: "numerics",
  MP005: "numerics",
  MP006: "inventory",
  MP007: "inventory",
  MP008: "loss_scale",
  MP009: "inventory",
  MP010: "gpu",
  MP011: "gpu",
  MP012: "numerics",
  MP013: "loss_scale",
};

export async function show(container, { focus, compared, navigate }) {
  container.append(el("h2", {}, "Runs"), comparisonTable(compared));
  const payload = await getJson("findings", { run: focus });
  container.append(el("h2", {}, "Findings for ", el("span", { class: "run-name" }, focus)));
  if (!payload.available) {
    container.append(notMeasured("Findings", payload.reason));
    return;
  }
  if (!payload.findings.length) {
    container.append(el("p", { class: "all-clear" }, "No findings: nothing looks wrong in this run."));
    return;
  }
  container.append(el("ol", { class: "findings" }, payload.findings.map((f) => findingItem(f, navigate))));
}

function comparisonTable(runs) {
  const rows = [
    ["policy", (r) => r.model_policy],
    ["optimizer", (r) => r.optimizer],
    ["leaf layers", (r) => r.leaf_layers],
    ["float32 islands", (r) => r.float32_islands],
    ["casts", (r) => r.casts],
    ["model output", (r) => (r.model_output_dtypes || []).join(", ")],
    ["steps run", (r) => r.loss_scale?.steps_run],
    ["overflows (skipped steps)", (r) => r.loss_scale?.overflows],
    ["loss scale initial → final", (r) =>
      r.loss_scale ? `${formatNumber(r.loss_scale.initial)} → ${formatNumber(r.loss_scale.final)}` : "no loss scaling"],
    ["per-layer numerics", (r) => (r.has_numerics ? "recorded" : "not measured")],
    ["GPU", (r) => r.gpu_mode ?? "not measured"],
    ["reader warnings", (r) => r.warnings],
  ];
  return el(
    "table",
    { class: "compare-table" },
    el("thead", {}, el("tr", {}, el("th", {}, ""), runs.map((r) => el("th", { class: "run-name" }, r.run)))),
    el(
      "tbody",
      {},
      rows.map(([label, value]) =>
        el("tr", {}, el("th", {}, label), runs.map((r) => el("td", {}, formatNumber(value(r))))),
      ),
    ),
  );
}

function findingItem(finding, navigate) {
  const view = EVIDENCE_VIEW[finding.code];
  const where = [
    finding.layer ? el("span", { class: "layer" }, "layer ", el("code", {}, finding.layer)) : null,
    finding.step !== null && finding.step !== undefined ? el("span", { class: "step" }, `step ${finding.step}`) : null,
  ];
  const evidence = Object.entries(finding.evidence || {}).map(([key, value]) =>
    el("li", {}, el("span", { class: "key" }, key), ": ", typeof value === "object" ? JSON.stringify(value) : formatNumber(value)),
  );
  return el(
    "li",
    { class: `finding severity-${finding.severity}` },
    el(
      "div",
      { class: "finding-head" },
      el("span", { class: "severity" }, finding.severity),
      el("span", { class: "code" }, finding.code),
      el("span", { class: "title" }, finding.title),
    ),
    el("div", { class: "finding-where" }, where),
    evidence.length ? el("ul", { class: "evidence" }, evidence) : null,
    el("pre", { class: "fix" }, finding.fix),
    view
      ? el(
          "button",
          { type: "button", class: "evidence-link", onclick: () => navigate(view, { layer: finding.layer, step: finding.step }) },
          "Show evidence →",
        )
      : null,
  );
}
