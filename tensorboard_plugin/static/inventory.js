// Precision inventory: every layer's dtypes as a sortable, filterable table,
// float32 islands, layers fed by casts and layers a finding names
// highlighted (a click on a row opens its numerics history); then the casts.

import { getJson } from "./api.js";
import { el, formatNumber, notMeasured, replace } from "./dom.js";

const COLUMNS = [
  ["call_index", "#"],
  ["name", "layer"],
  ["class", "class"],
  ["policy", "policy"],
  ["compute_dtype", "compute"],
  ["variable_dtype", "variables"],
  ["output_dtypes", "outputs"],
  ["params", "params"],
  ["gemm_dims", "GEMM dims"],
  ["tensor_core_friendly", "Tensor Core shapes"],
  ["findings", "findings"],
  ["flags", "notes"],
];

export async function show(container, { focus, target, navigate, runs, compared, offerCsv }) {
  const [inventory, findings] = await Promise.all([
    getJson("inventory", { run: focus }),
    getJson("findings", { run: focus }),
  ]);
  if (!inventory.available) {
    container.append(notMeasured("Precision inventory", inventory.reason));
    return;
  }
  const castInto = new Set(inventory.casts.map((cast) => cast.layer));
  const named = findingsByLayer(findings.available ? findings.findings : []);
  const layers = inventory.layers.map((layer) => ({
    ...layer,
    flags: flagsOf(layer, castInto),
    findings: named.get(layer.name) ?? [],
  }));
  const hasNumerics = runs.find((run) => run.run === focus)?.has_numerics;
  const openLayer = hasNumerics ? (layer) => navigate("numerics", { layer }) : null;
  const state = { sortKey: "call_index", ascending: true, text: "", onlyFlagged: false };
  const body = el("tbody");
  const count = el("span", { class: "count" });
  const draw = () => drawRows(body, count, layers, state, openLayer, target.layer);
  offerCsv("inventory", [
    COLUMNS.map(([, label]) => label),
    ...layers.map((layer) => COLUMNS.map(([key]) => cell(layer, key))),
  ]);
  const head = el(
    "tr",
    {},
    COLUMNS.map(([key, label]) =>
      el("th", { class: "sortable", "data-key": key, onclick: () => {
        state.ascending = state.sortKey === key ? !state.ascending : true;
        state.sortKey = key;
        draw();
      } }, label),
    ),
  );
  const model = inventory.model || {};
  container.append(
    el("p", { class: "model-line" }, `model ${model.name} (${model.class}), policy ${model.policy}, outputs ${(model.output_dtypes || []).join(", ")}, ${formatNumber(model.params)} parameters`),
    el(
      "div",
      { class: "filters" },
      el("input", { type: "search", placeholder: "filter layers (name, class, dtype)", value: state.text, "aria-label": "filter layers",
        oninput: (e) => { state.text = e.target.value; draw(); } }),
      el("label", {}, el("input", { type: "checkbox", onchange: (e) => { state.onlyFlagged = e.target.checked; draw(); } }),
        " only float32 islands, casts, misaligned shapes and layers with findings"),
      count,
    ),
    openLayer ? el("p", { class: "hint" }, "Click a row for the layer's numerics history.") : null,
    el("table", { class: "inventory" }, el("thead", {}, head), body),
    el("h3", {}, `Casts between layers (${inventory.casts.length})`),
    castsTable(inventory.casts),
  );
  draw();
  const others = compared.filter((run) => run.run !== focus);
  if (others.length) container.append(await comparison(focus, inventory, others));
}

/**
 * The layers whose compute or output dtypes differ between the focus run and
 * the compared runs (by layer name), or that only some of them have.
 */
async function comparison(focus, inventory, others) {
  const inventories = [[focus, inventory], ...(await Promise.all(
    others.map(async (run) => [run.run, await getJson("inventory", { run: run.run })]),
  ))].filter(([, payload]) => payload.available);
  const describe = (layer) => (layer ? `${layer.compute_dtype ?? "–"} → ${(layer.output_dtypes || []).join(", ") || "–"}` : "(no such layer)");
  const byRun = inventories.map(([, payload]) => new Map(payload.layers.filter((l) => l.is_leaf).map((l) => [l.name, l])));
  const names = [...new Set(byRun.flatMap((layers) => [...layers.keys()]))];
  const differing = names.filter((name) => new Set(byRun.map((layers) => describe(layers.get(name)))).size > 1);
  const heading = el("h3", {}, `Compared with ${inventories.length - 1} other run(s): ${differing.length} of ${names.length} layers compute or output differently (compute dtype → output dtypes)`);
  if (!differing.length) return el("section", { class: "inventory-diff" }, heading);
  return el(
    "section",
    { class: "inventory-diff" },
    heading,
    el("div", { class: "scroll" }, el(
      "table",
      { class: "diff" },
      el("thead", {}, el("tr", {}, el("th", {}, "layer"), inventories.map(([run]) => el("th", { class: "run-name" }, run)))),
      el("tbody", {}, differing.map((name) => el("tr", {}, el("td", {}, name), byRun.map((layers) => el("td", {}, describe(layers.get(name))))))),
    )),
  );
}

function flagsOf(layer, castInto) {
  const flags = [];
  if (layer.float32_island) flags.push("float32 island");
  if (castInto.has(layer.name)) flags.push("cast in");
  if (layer.misaligned_dims?.length) flags.push(`not a multiple of 8: ${layer.misaligned_dims.join(", ")}`);
  return flags;
}

/** Layer name -> the findings naming it ("MP003 critical"). */
function findingsByLayer(findings) {
  const named = new Map();
  for (const finding of findings) {
    if (!finding.layer) continue;
    if (!named.has(finding.layer)) named.set(finding.layer, []);
    named.get(finding.layer).push(finding);
  }
  return named;
}

function drawRows(body, count, layers, { sortKey, ascending, text, onlyFlagged }, openLayer, current) {
  const needle = text.trim().toLowerCase();
  const shown = layers
    .filter((layer) => !onlyFlagged || layer.flags.length || layer.findings.length)
    .filter((layer) => !needle || searchText(layer).includes(needle))
    .sort((a, b) => compare(a[sortKey], b[sortKey]) * (ascending ? 1 : -1));
  replace(body, shown.map((layer) => row(layer, openLayer, current)));
  count.textContent = `${shown.length} of ${layers.length} layers`;
}

function row(layer, openLayer, current) {
  const severity = layer.findings[0]?.severity;
  const classes = [
    layer.float32_island ? "island" : "",
    layer.flags.includes("cast in") ? "cast" : "",
    layer.is_leaf ? "" : "container",
    severity ? `offender offender-${severity}` : "",
    layer.name === current ? "current" : "",
    openLayer && layer.is_leaf ? "linked" : "",
  ];
  return el(
    "tr",
    {
      class: classes.filter(Boolean).join(" "),
      "data-layer": layer.name,
      onclick: openLayer && layer.is_leaf ? () => openLayer(layer.name) : null,
    },
    COLUMNS.map(([key]) => el("td", { class: `col-${key}` }, key === "findings" ? findingBadges(layer.findings) : cell(layer, key))),
  );
}

function findingBadges(findings) {
  return findings.map((finding) =>
    el("span", { class: `badge badge-${finding.severity}`, title: finding.title }, finding.code),
  );
}

function cell(layer, key) {
  const value = layer[key];
  if (key === "findings") return value.map((finding) => finding.code).join(" ");
  if (key === "tensor_core_friendly") return value === null || value === undefined ? "–" : value ? "yes" : "no";
  if (Array.isArray(value)) return value.join(key === "flags" ? "; " : ", ");
  return formatNumber(value);
}

function searchText(layer) {
  return [layer.name, layer.class, layer.policy, layer.compute_dtype, layer.variable_dtype, ...(layer.output_dtypes || []), ...layer.flags, ...layer.findings.map((f) => f.code)]
    .join(" ")
    .toLowerCase();
}

function compare(a, b) {
  const missing = (v) => v === null || v === undefined;
  if (missing(a) || missing(b)) return missing(a) - missing(b);
  if (Array.isArray(a) || Array.isArray(b)) return String(a).localeCompare(String(b));
  return typeof a === "number" && typeof b === "number" ? a - b : String(a).localeCompare(String(b));
}

function castsTable(casts) {
  if (!casts.length) return el("p", {}, "No casts between layers.");
  return el(
    "table",
    { class: "casts" },
    el("thead", {}, el("tr", {}, ["from layer", "dtype", "into layer", "dtype"].map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      casts.map((cast) =>
        el("tr", {}, el("td", {}, cast.from_layer ?? "(model input)"), el("td", {}, cast.from_dtype), el("td", {}, cast.layer ?? "–"), el("td", {}, cast.to_dtype)),
      ),
    ),
  );
}
