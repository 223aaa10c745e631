// Draws every <div class="plot"> of an mpprof report from the embedded data.
// Labels arrive already escaped: plotly renders labels as markup.
// Colours follow the reader's colour scheme (prefers-color-scheme).
(function () {
  const runs = JSON.parse(document.getElementById("mpprof-data").textContent);
  const config = {responsive: true, displaylogo: false};
  const dark = window.matchMedia("(prefers-color-scheme: dark)").matches;
  const theme = dark
    ? {paper: "#1e1f22", text: "#e0e0e0", grid: "#444", noData: "#5f6368", scale: "#8ab4f8"}
    : {paper: "#ffffff", text: "#222", grid: "#e5e5e5", noData: "#bdbdbd", scale: "#1f77b4"};
  // The dashboard's headroom colours (tensorboard_plugin/static/numerics.js).
  const HEADROOM_COLORS = [[0, "#b2182b"], [0.1, "#ef8a62"], [0.35, "#fddbc7"], [0.6, "#d1e5f0"], [1, "#2166ac"]];
  // Plotly's default line colours, one per float8 layer.
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  function layout(extra) {
    const axis = (a) => Object.assign({gridcolor: theme.grid, zerolinecolor: theme.grid}, a || {});
    return Object.assign({paper_bgcolor: theme.paper, plot_bgcolor: theme.paper,
                          font: {color: theme.text}, margin: {t: 40}}, extra,
                         {xaxis: axis(extra.xaxis), yaxis: axis(extra.yaxis)});
  }
  function stepAxis(steps) {
    const span = steps.length ? steps[steps.length - 1] - steps[0] : 0;
    return Object.assign({title: {text: "train step"}, tickformat: "d"}, span < 10 ? {dtick: 1} : {});
  }
  function lossScale(div, run) {
    const d = run.loss_scale;
    const traces = [{x: d.steps, y: d.scales, mode: "lines", line: {shape: "hv", color: theme.scale},
                     name: "loss scale"}];
    const marker = (m, name, symbol, color) => ({
      x: m.steps, y: m.scales, mode: "markers", name: name,
      marker: {symbol: symbol, color: color, size: 7},
      text: m.counts ? m.counts.map(c => c + " " + name) : null,
      hovertemplate: "step %{x}<br>scale %{y}" + (m.counts ? "<br>%{text}" : "") +
                     "<extra>" + name + "</extra>"});
    if (d.overflows.steps.length) traces.push(marker(d.overflows, "overflows", "x-thin-open", "#e53935"));
    if (d.growths.steps.length) traces.push(marker(d.growths, "growths", "triangle-up-open", "#43a047"));
    Plotly.newPlot(div, traces, layout({
      title: {text: "Loss scale (" + d.overflow_count + " overflows, " +
                    d.growth_count + " growths)"},
      xaxis: stepAxis(d.steps), yaxis: {title: {text: "loss scale (log)"}, type: "log"},
      shapes: [{type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: 1, y1: 1,
                line: {color: theme.text, dash: "dot", width: 1}}],
      annotations: [{xref: "paper", yref: "y", x: 1, y: 0, xanchor: "right", yanchor: "bottom",
                     text: "scale 1", showarrow: false, font: {size: 10}}],
      height: 340}), config);
  }
  function numerics(div, run) {
    const n = run.numerics, key = div.dataset.map;
    const direction = key.startsWith("forward") ? "forward" : "backward";
    const cells = n.overflow[direction];
    const spec = {
      forward_headroom: {
        title: "Forward headroom: bits left below " + n.dtype + "'s largest value " +
               Number(n.policy_max).toPrecision(5) + " (red: little left; below 0: overflowed)",
        colorscale: HEADROOM_COLORS, zmin: -1, zmax: n.headroom_color_max, unit: "bits of headroom"},
      backward_log10_abs_max: {
        title: "Backward: log10 |max| of the (scaled) gradient into each layer",
        colorscale: "Viridis", zmin: null, zmax: null, unit: "log10 |value|"},
      forward_nonfinite_frac: {
        title: "Forward: share of non-finite output values",
        colorscale: "Reds", zmin: 0, zmax: 1, unit: "share of values"},
      backward_underflow_frac: n.underflow_applies ? {
        title: "Backward: share of non-zero gradients below float16's smallest normal",
        colorscale: [[0, "#f7f7f7"], [1, "#54278f"]], zmin: 0, zmax: 1, unit: "share of values"} : {
        title: "Backward: share below float16's smallest normal (informative only: " + n.dtype +
               " keeps float32's range, these values do not underflow)",
        colorscale: "Greys", zmin: 0, zmax: 1, unit: "share of values"},
    }[key];
    const traces = [{type: "heatmap", z: n.maps[key], x: n.steps, y: n.layers,
      colorscale: spec.colorscale, zmin: spec.zmin, zmax: spec.zmax, hoverongaps: false,
      colorbar: {title: {text: spec.unit, side: "right"}},
      hovertemplate: "layer %{y}<br>step %{x}<br>%{z} " + spec.unit + "<extra></extra>"}];
    if (cells.layer.length) {
      traces.push({type: "scatter", mode: "markers", name: "overflow",
        x: cells.column.map(c => n.steps[c]), y: cells.layer.map(l => n.layers[l]),
        marker: {symbol: "x", color: "#ff1744", size: 9},
        hovertemplate: "overflowed<br>layer %{y}<br>step %{x}<extra></extra>"});
    }
    Plotly.newPlot(div, traces, layout({
      title: {text: spec.title, font: {size: 13}},
      xaxis: stepAxis(n.steps),
      yaxis: {autorange: "reversed", type: "category", automargin: true},
      // Cells without a sample show the background: grey, unlike a 0.
      plot_bgcolor: theme.noData, showlegend: false,
      height: Math.min(3000, Math.max(320, 60 + 16 * n.layers.length))}), config);
  }
  function gpu(div, run) {
    const track = run.gpu[Number(div.dataset.track)];
    Plotly.newPlot(div, track.lines.map(l => ({x: l.x, y: l.y, name: l.name, mode: "lines"})), layout({
      title: {text: track.title}, xaxis: {title: {text: "seconds since the first sample"}},
      height: 260}), config);
  }
  function float8Share(div, run) {
    const f = run.float8, key = div.dataset.map;
    const spec = {
      saturated: {title: "Float8 saturation: share of each tensor's values beyond the format's max (clipped)",
                  colorscale: [[0, "#f7f7f7"], [1, "#b2182b"]]},
      underflowed: {title: "Float8 underflow: share of each tensor's non-zero values that quantize to zero",
                    colorscale: [[0, "#f7f7f7"], [1, "#54278f"]]},
    }[key];
    Plotly.newPlot(div, [{type: "heatmap", z: f.maps[key], x: f.steps, y: f.rows,
      colorscale: spec.colorscale, zmin: 0, zmax: 1, hoverongaps: false,
      colorbar: {title: {text: "share", side: "right"}, tickformat: ".0%"},
      hovertemplate: "%{y}<br>step %{x}<br>%{z:.2%}<extra></extra>"}], layout({
      title: {text: spec.title, font: {size: 13}},
      xaxis: stepAxis(f.steps),
      yaxis: {autorange: "reversed", type: "category", automargin: true},
      plot_bgcolor: theme.noData,
      height: Math.min(3000, Math.max(320, 60 + 16 * f.rows.length))}), config);
  }
  function float8Scale(div, run) {
    const f = run.float8, tensor = f.tensors[div.dataset.tensor];
    const traces = [];
    // A magnitude of 0 cannot sit on a log axis: a gap.
    const positive = (values) => values.map(v => (v === 0 ? null : v));
    tensor.lines.forEach(function (line, i) {
      const color = COLORS[i % COLORS.length];
      traces.push({x: line.steps, y: positive(line.amax), mode: "lines+markers", name: f.layers[i] + " amax",
                   legendgroup: String(i), line: {color: color}, marker: {size: 4}});
      traces.push({x: line.steps, y: positive(line.scale_range), mode: "lines",
                   name: f.layers[i] + " scale x max", legendgroup: String(i),
                   line: {color: color, dash: "dash"}});
    });
    const first = tensor.lines.length ? tensor.lines[0].steps : [];
    Plotly.newPlot(div, traces, layout({
      title: {text: "Float8 " + tensor.title + ": latest amax (solid) and scale x format max (dashed): an amax above its dashed line was clipped", font: {size: 13}},
      xaxis: stepAxis(first), yaxis: {type: "log", title: {text: "|value| (log)"}, exponentformat: "power"},
      height: 360}), config);
  }
  const draw = {loss_scale: lossScale, numerics: numerics, gpu: gpu,
                float8_share: float8Share, float8_scale: float8Scale};
  document.querySelectorAll("div.plot").forEach(function (div) {
    draw[div.dataset.kind](div, runs[Number(div.dataset.run)]);
  });
})();
