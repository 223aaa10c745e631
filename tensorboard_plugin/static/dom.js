// DOM helpers. Every string from a run (layer names, run names, findings)
// becomes a text node or a textContent: never parsed as HTML.

/** Creates an element; string/number children become text nodes. */
export function el(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") element.className = value;
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name in element && typeof value !== "string") element[name] = value;
    else element.setAttribute(name, value === true ? "" : value);
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces the children of `element`. */
export function replace(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

/**
 * Escapes text for plotly, which renders labels, hover text and legends as
 * a subset of HTML: "<img ...>" in a run or layer name must stay text.
 */
export function plotlyText(value) {
  return String(value ?? "")
    .replaceAll("&", "&amp;")
    .replaceAll("<", "&lt;")
    .replaceAll(">", "&gt;")
    .replaceAll('"', "&quot;")
    .replaceAll("'", "&#39;")
    // "%{x}" in a name would be a hovertemplate field; "&#37;" shows as "%".
    .replaceAll("%", "&#37;");
}

/** A "not measured" note saying why a view has nothing to show. */
export function notMeasured(what, reason) {
  return el("p", { class: "not-measured" }, `${what}: not measured`, reason ? ` (${reason})` : "");
}

export function formatNumber(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e9) return value.toLocaleString("en-US");
  return value.toPrecision(digits);
}

/** Per severity, a small coloured count (only the non-zero ones). */
export function severityBadges(counts = {}) {
  return ["critical", "warning", "info"]
    .filter((severity) => counts[severity])
    .map((severity) =>
      el("span", { class: `badge badge-${severity}`, title: `${counts[severity]} ${severity}` }, String(counts[severity])),
    );
}
