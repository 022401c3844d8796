// A small line chart on <canvas>, written for this dashboard (no library, no network).
// lineChart(canvas, [{label, color, points: [{x, y}]}], {xLabel, time}) draws axes, ticks, lines and a legend,
// and records the number of points drawn in canvas.dataset.points (the browser test reads it).
(function () {
  const PAD = { l: 52, r: 12, t: 26, b: 34 };

  function ticks(lo, hi, n) {
    if (lo === hi) { lo -= 1; hi += 1; }
    const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    const err = (hi - lo) / n / step;
    const nice = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
    const out = [];
    for (let v = Math.ceil(lo / nice) * nice; v <= hi + nice * 1e-9; v += nice) out.push(+v.toPrecision(12));
    return { lo: Math.min(lo, out[0]), hi: Math.max(hi, out[out.length - 1]), values: out };
  }

  function fmt(v, time) {
    if (time) return new Date(v).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
    return Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(1) : String(+v.toFixed(3));
  }

  function lineChart(canvas, series, opts = {}) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 360, h = canvas.clientHeight || 220;
    canvas.width = w * dpr; canvas.height = h * dpr;
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.clearRect(0, 0, w, h);
    const pts = series.flatMap(s => s.points).filter(p => Number.isFinite(p.x) && Number.isFinite(p.y));
    canvas.dataset.points = String(pts.length);
    ctx.font = "11px system-ui, sans-serif";
    if (!pts.length) { ctx.fillStyle = "#5b6475"; ctx.fillText("no data yet", w / 2 - 28, h / 2); return; }
    const xs = ticks(Math.min(...pts.map(p => p.x)), Math.max(...pts.map(p => p.x)), 5);
    const ys = ticks(Math.min(...pts.map(p => p.y)), Math.max(...pts.map(p => p.y)), 4);
    const X = x => PAD.l + (x - xs.lo) / (xs.hi - xs.lo) * (w - PAD.l - PAD.r);
    const Y = y => h - PAD.b - (y - ys.lo) / (ys.hi - ys.lo) * (h - PAD.t - PAD.b);
    drawAxes(ctx, xs, ys, X, Y, w, h, opts);
    let legendX = PAD.l + 8;
    series.forEach((s, i) => { legendX = drawSeries(ctx, s, X, Y, i, legendX); });
  }

  function drawAxes(ctx, xs, ys, X, Y, w, h, opts) {
    ctx.strokeStyle = "#e3e6eb"; ctx.fillStyle = "#5b6475"; ctx.lineWidth = 1;
    ys.values.forEach(v => {
      ctx.beginPath(); ctx.moveTo(PAD.l, Y(v)); ctx.lineTo(w - PAD.r, Y(v)); ctx.stroke();
      ctx.fillText(fmt(v), 4, Y(v) + 4);
    });
    const xt = opts.time ? xs.values.filter((_, i) => i % 2 === 0) : xs.values;
    xt.forEach(v => ctx.fillText(fmt(v, opts.time), X(v) - 10, h - PAD.b + 14));
    if (opts.xLabel) ctx.fillText(opts.xLabel, w / 2 - 20, h - 4);
  }

  function drawSeries(ctx, s, X, Y, i, legendX) {
    const color = s.color || ["#3b82f6", "#22c55e", "#ef4444", "#a855f7", "#f59e0b"][i % 5];
    const p = s.points.filter(q => Number.isFinite(q.x) && Number.isFinite(q.y)).sort((a, b) => a.x - b.x);
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 2;
    ctx.beginPath();
    p.forEach((q, j) => (j ? ctx.lineTo(X(q.x), Y(q.y)) : ctx.moveTo(X(q.x), Y(q.y))));
    ctx.stroke();
    p.forEach(q => { ctx.beginPath(); ctx.arc(X(q.x), Y(q.y), 2.5, 0, 2 * Math.PI); ctx.fill(); });
    ctx.fillRect(legendX, 8, 10, 10);
    ctx.fillStyle = "#1d2330"; ctx.fillText(s.label, legendX + 14, 17);
    return legendX + 28 + ctx.measureText(s.label).width;
  }

  window.lineChart = lineChart;
})();
