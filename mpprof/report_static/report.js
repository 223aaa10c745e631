// Draws every <div class="plot"> of an mpprof report from the embedded data.
// Labels arrive already escaped: plotly renders labels as markup.
(function () {
  const runs = JSON.parse(document.getElementById("mpprof-data").textContent);
  const config = {responsive: true, displaylogo: false};
  const titles = {
    forward_log10_abs_max: "Forward: log10 |max| of each layer's output",
    backward_log10_abs_max: "Backward: log10 |max| of the (scaled) gradient into each layer",
    forward_nonfinite_frac: "Forward: share of non-finite values",
    backward_underflow_frac: "Backward: share of non-zero gradients below float16's smallest normal",
  };
  function lossScale(div, run) {
    const d = run.loss_scale;
    const traces = [{x: d.steps, y: d.scales, mode: "lines", line: {shape: "hv"},
                     name: "loss scale"}];
    const marker = (m, name, symbol, color) => ({
      x: m.steps, y: m.scales, mode: "markers", name: name,
      marker: {symbol: symbol, color: color, size: 8},
      text: m.counts ? m.counts.map(c => c + " " + name) : null,
      hovertemplate: "step %{x}<br>scale %{y}" + (m.counts ? "<br>%{text}" : "") +
                     "<extra>" + name + "</extra>"});
    if (d.overflows.steps.length) traces.push(marker(d.overflows, "overflows", "x", "#c62828"));
    if (d.growths.steps.length) traces.push(marker(d.growths, "growths", "triangle-up", "#2e7d32"));
    Plotly.newPlot(div, traces, {
      title: {text: "Loss scale (" + d.overflow_count + " overflows, " +
                    d.growth_count + " growths)"},
      xaxis: {title: {text: "step"}}, yaxis: {title: {text: "scale"}, type: "log"},
      margin: {t: 40}, height: 340}, config);
  }
  function numerics(div, run) {
    const n = run.numerics, key = div.dataset.map;
    const isLog = key.indexOf("log10") >= 0;
    const direction = key.startsWith("forward") ? "forward" : "backward";
    const cells = n.overflow[direction];
    // Forward magnitudes in float16 end at its maximum (yellow = no headroom);
    // bfloat16's maximum (1e38) would squash every colour, so it is left out.
    const capAtMax = key === "forward_log10_abs_max" && n.policy_log10_max < 10;
    const traces = [{type: "heatmap", z: n.maps[key], x: n.steps.map(String), y: n.layers,
      colorscale: isLog ? "Viridis" : "Reds",
      zmin: isLog ? null : 0, zmax: capAtMax ? n.policy_log10_max : (isLog ? null : 1),
      hovertemplate: "layer %{y}<br>step %{x}<br>%{z}<extra></extra>"}];
    if (cells.layer.length) {
      traces.push({type: "scatter", mode: "markers", name: "overflow",
        x: cells.column.map(c => String(n.steps[c])), y: cells.layer.map(l => n.layers[l]),
        marker: {symbol: "x", color: "#ff1744", size: 9},
        hovertemplate: "overflow<br>layer %{y}<br>step %{x}<extra></extra>"});
    }
    Plotly.newPlot(div, traces, {
      title: {text: titles[key] || key},
      xaxis: {title: {text: "step"}, type: "category"},
      yaxis: {autorange: "reversed", type: "category", automargin: true},
      margin: {t: 40}, showlegend: false,
      height: Math.min(3000, Math.max(320, 60 + 16 * n.layers.length))}, config);
  }
  function gpu(div, run) {
    const track = run.gpu[Number(div.dataset.track)];
    Plotly.newPlot(div, track.lines.map(l => ({x: l.x, y: l.y, name: l.name, mode: "lines"})), {
      title: {text: track.title}, xaxis: {title: {text: "seconds"}},
      margin: {t: 40}, height: 260}, config);
  }
  const draw = {loss_scale: lossScale, numerics: numerics, gpu: gpu};
  document.querySelectorAll("div.plot").forEach(function (div) {
    draw[div.dataset.kind](div, runs[Number(div.dataset.run)]);
  });
})();
