// Overview: the compared runs side by side (most severe first, with their
// finding counts), then the focus run's findings, most severe first, each
// linking to the view that holds its evidence, then what was not checked.
// Draws no chart: it paints before plotly.js has loaded.

import { getJson } from "./api.js";
import { compareSeverity } from "./charts.js";
import { el, formatNumber, notMeasured, severityBadges } from "./dom.js";

// Which view shows the evidence of each finding code (see the README's
// finding catalogue), for findings that do not name their view themselves.
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

export async function show(container, { focus, compared, navigate, offerCsv }) {
  const runs = [...compared].sort(compareSeverity);
  const table = comparisonTable(runs, navigate);
  offerCsv("runs", table.csv);
  container.append(el("h2", {}, "Runs (most severe first)"), table.element);
  const payload = await getJson("findings", { run: focus });
  container.append(el("h2", {}, "Findings for ", el("span", { class: "run-name" }, focus)));
  if (!payload.available) {
    container.append(notMeasured("Findings", payload.reason));
    return;
  }
  if (!payload.findings.length) {
    container.append(el("p", { class: "all-clear" }, "No findings: nothing looks wrong in this run."));
  } else {
    container.append(el("ol", { class: "findings" }, payload.findings.map((f) => findingItem(f, navigate))));
  }
  const notes = payload.not_checked || [];
  if (notes.length) {
    container.append(
      el("h3", {}, `Not checked (${notes.length})`),
      el(
        "ul",
        { class: "not-checked" },
        notes.map((note) =>
          el("li", {}, el("span", { class: "code" }, note.code ?? ""), ` ${note.status ?? "not measured"}: `, note.reason ?? ""),
        ),
      ),
    );
  }
}

function comparisonTable(runs, navigate) {
  const rows = [
    ["fit", (r) => (r.readable === false ? "nothing readable"
      : r.cut_short ? `cut short at step ${r.cut_short.step} (${r.cut_short.fit_state})`
      : ({ unknown: "not recorded" })[r.fit_state] ?? r.fit_state ?? "not recorded")],
    ["policy", (r) => r.model_policy],
    ["optimizer", (r) => r.optimizer],
    ["float32 matmuls", (r) => r.float32_matmuls ?? "not recorded"],
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
  const counts = (r) => ["critical", "warning", "info"].map((s) => `${r.findings?.[s] ?? 0} ${s}`).join(", ");
  const element = el(
    "table",
    { class: "compare-table" },
    el("thead", {}, el("tr", {}, el("th", {}, ""), runs.map((r) => el("th", { class: "run-name" }, r.run)))),
    el(
      "tbody",
      {},
      el(
        "tr",
        { class: "finding-counts" },
        el("th", {}, "findings"),
        runs.map((r) => el("td", {}, severityBadges(r.findings), r.findings && Object.values(r.findings).some(Boolean) ? "" : "none")),
      ),
      rows.map(([label, value]) =>
        el("tr", {}, el("th", {}, label), runs.map((r) => el("td", {}, formatNumber(value(r))))),
      ),
    ),
  );
  const csv = [
    ["", ...runs.map((r) => r.run)],
    ["findings", ...runs.map(counts)],
    ...rows.map(([label, value]) => [label, ...runs.map((r) => value(r) ?? "")]),
  ];
  return { element, csv };
}

function findingItem(finding, navigate) {
  const view = finding.view || EVIDENCE_VIEW[finding.code];
  const where = [
    finding.layer ? el("span", { class: "layer" }, "layer ", el("code", {}, finding.layer)) : null,
    finding.step !== null && finding.step !== undefined ? el("span", { class: "step" }, `step ${finding.step}`) : null,
  ];
  const evidence = Object.entries(finding.evidence || {}).map(([key, value]) =>
    el("li", {}, el("span", { class: "key" }, key), ": ", typeof value === "object" && value !== null ? JSON.stringify(value) : formatNumber(value)),
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
    finding.replay
      ? el("details", { class: "replay" }, el("summary", {}, finding.replay.headline), el("pre", {}, finding.replay.lines.join("\n")))
      : null,
    view
      ? el(
          "button",
          { type: "button", class: "evidence-link", onclick: () => navigate(view, { layer: finding.layer, step: finding.step }) },
          "Show evidence →",
        )
      : null,
  );
}
