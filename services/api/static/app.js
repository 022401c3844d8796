// The dashboard: runs list, run page (curves, throughput, ledger, trajectories), trajectory viewer.
// Plain JS over the REST API; the token comes from ?token=... or the header form and is kept in localStorage.
// Charts are uPlot's (vendor/uplot, from npm).
(function () {
  const view = document.getElementById("view");
  const params = new URLSearchParams(location.search);
  if (params.get("token")) localStorage.setItem("flywheel_token", params.get("token"));
  let timer = null;
  let plots = [];  // the run page's uPlot instances, destroyed before the page is drawn again

  document.getElementById("token-form").addEventListener("submit", e => {
    e.preventDefault();
    localStorage.setItem("flywheel_token", document.getElementById("token-input").value);
    route();
  });

  async function api(path) {
    const r = await fetch("/v1" + path, { headers: { Authorization: "Bearer " + (localStorage.getItem("flywheel_token") || "") } });
    if (r.status === 401) throw new Error("enter a valid API token (top right) or open the page with ?token=...");
    if (!r.ok) {  // the API's one error shape: {message, detail: [{field, message, hint}]}
      const body = await r.json().catch(() => ({ message: r.statusText }));
      throw new Error(`${r.status}: ${body.message || r.statusText}`);
    }
    return r.json();
  }

  const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const num = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toFixed(d) : esc(v));
  const status = s => `<span class="status ${esc(s)}">${esc(s)}</span>`;
  const when = t => (t ? new Date(t).toLocaleString() : "–");

  async function runsPage() {
    const runs = (await api("/runs?limit=200")).data;
    view.innerHTML = `<h2>Runs</h2><table id="runs"><thead><tr><th>name</th><th>kind</th><th>status</th>
      <th>policy version</th><th>created</th></tr></thead><tbody>${runs.map(r => `
      <tr class="link" data-href="#/runs/${esc(r.id)}"><td>${esc(r.name)}</td><td>${esc(r.kind)}</td>
      <td>${status(r.status)}${r.error ? ` <span class="error">${esc(r.error)}</span>` : ""}</td><td>${r.policy_version}</td><td>${when(r.created_at)}</td></tr>`).join("")}
      </tbody></table>${runs.length ? "" : "<p>No runs yet: start one with <code>flywheel runs start -f run.yaml</code>.</p>"}`;
  }

  const CHARTS = [
    ["reward", "reward over policy versions", m => /(^|\/)reward/.test(m) && !/std/.test(m)],
    ["pass", "pass rate over policy versions", m => /pass/.test(m)],
    ["kl", "KL over policy versions", m => /kl/i.test(m)],
    ["entropy", "entropy over policy versions", m => /entropy/i.test(m)],
    ["throughput", "throughput", m => /throughput|per_s|tokens_s/i.test(m)],
  ];

  const COLORS = ["#3b82f6", "#22c55e", "#ef4444", "#a855f7", "#f59e0b"];
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];  // versions, steps

  // A line chart in `el` of series [{label, points: [{x, y}]}] (x: a number, or seconds since the epoch with
  // opts.time). uPlot wants one shared x array: the union of every series' x, null where a series has no point.
  // The number of points drawn goes to el.dataset.points (the browser test reads it).
  function lineChart(el, series, opts = {}) {
    const lines = series.map(s => ({ label: s.label, points: s.points.filter(p => Number.isFinite(p.x) && Number.isFinite(p.y)) }));
    const count = lines.reduce((n, s) => n + s.points.length, 0);
    el.dataset.points = String(count);
    if (!count) { el.innerHTML = `<p class="empty">no data yet</p>`; return; }
    const xs = [...new Set(lines.flatMap(s => s.points.map(p => p.x)))].sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const ys = lines.map(s => {
      const column = xs.map(() => null);
      s.points.forEach(p => { column[index.get(p.x)] = p.y; });
      return column;
    });
    const pad = opts.time ? 60 : 1;  // a single x value (one version so far) still gets an axis around it
    plots.push(new uPlot({
      width: el.clientWidth || 360, height: 220, legend: { live: false },
      scales: { x: { time: !!opts.time, range: (u, lo, hi) => (xs.length === 1 ? [xs[0] - pad, xs[0] + pad] : [lo, hi]) } },
      axes: [{ label: opts.xLabel, ...(opts.time ? {} : { incrs: INTEGER_STEPS }) }, { size: 56 }],
      series: [{ label: opts.xLabel }, ...lines.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { size: 5 },
      }))],
    }, [xs, ...ys], el));
  }

  async function runPage(id) {
    const [run, metrics, rewards, trajs] = await Promise.all([
      api(`/runs/${id}`), api(`/runs/${id}/metrics`), api(`/runs/${id}/rewards`), api(`/runs/${id}/trajectories?limit=50`),
    ]);
    const u = run.ledger.units, a = run.ledger.attempts, p = run.progress;
    view.innerHTML = `<h2>${esc(run.name)} ${status(run.status)}</h2>
      <p class="meta">${esc(run.kind)} run ${esc(run.id)} · model ${esc(run.config.model)} · dataset ${esc(run.config.dataset)}
        · created ${when(run.created_at)}</p>
      ${run.error ? `<p class="error" id="run-error">${esc(run.error)}</p>` : ""}
      <div class="progress" title="progress"><div style="width:${Math.round((p.fraction || 0) * 100)}%"></div></div>
      <div class="cards" id="ledger">
        <div class="card">policy version<b>${run.policy_version}</b></div>
        <div class="card">progress (${esc(p.unit)})<b>${p.done}${p.total !== null ? " / " + p.total : ""}</b></div>
        <div class="card" title="(task, sample) units; they add up to ${u.total}">samples completed<b>${u.completed}</b></div>
        <div class="card">samples failed<b>${u.failed}</b></div>
        <div class="card">samples in flight<b>${u.in_flight + u.retrying}</b></div>
        ${u.cancelled ? `<div class="card">samples cancelled<b>${u.cancelled}</b></div>` : ""}
        <div class="card" title="completed ${a.completed}, failed ${a.failed}, lost ${a.lost}, cancelled ${a.cancelled}">attempts<b>${a.total}</b></div>
        ${Object.entries(run.pass_at_k || {}).map(([k, v]) => `<div class="card">${esc(k)}<b>${num(v)}</b></div>`).join("")}
      </div>
      <div class="charts">${CHARTS.map(([key, title]) => `<div class="chart"><h3>${title}</h3><div class="plot" id="chart-${key}"></div></div>`).join("")}
        <div class="chart"><h3>reward over time</h3><div class="plot" id="chart-time"></div></div></div>
      <h3>Trajectories (${trajs.count})</h3>
      <table id="trajectories"><thead><tr><th>task</th><th>sample</th><th>reward</th><th>termination</th><th>steps</th>
        <th>tokens (prompt / response)</th><th>policy version</th></tr></thead><tbody>${trajs.data.map(t => `
        <tr class="link" data-href="#/trajectories/${esc(t.id)}"><td>${esc(t.task_id)}</td><td>${t.sample_idx}</td>
        <td>${num(t.reward)}</td><td>${esc(t.termination_reason)}</td><td>${t.num_steps}</td>
        <td>${t.prompt_tokens} / ${t.response_tokens}</td><td>${t.policy_version_min}–${t.policy_version_max}</td></tr>`).join("")}
      </tbody></table>`;
    drawRunCharts(metrics.series, rewards.data);
    if (!["stopped", "completed", "failed"].includes(run.status)) timer = setTimeout(() => route(), 3000);
  }

  function drawRunCharts(series, rewards) {
    const byVersion = key => rewards.map(r => ({ x: r.policy_version, y: r[key] })).filter(q => q.x !== null);
    for (const [key, , match] of CHARTS) {
      const lines = Object.entries(series).filter(([name]) => match(name))
        .map(([name, pts]) => ({ label: name, points: pts.map(q => ({ x: q.step, y: q.value })) }));
      if (key === "reward") lines.unshift({ label: "mean reward (trajectories)", points: byVersion("mean_reward") });
      if (key === "pass") lines.unshift({ label: "pass rate (trajectories)", points: byVersion("pass_rate") });
      lineChart(document.getElementById(`chart-${key}`), lines.slice(0, 4), { xLabel: key === "throughput" ? "step" : "policy version" });
    }
    const timed = Object.entries(series).filter(([name]) => /(^|\/)reward/.test(name))
      .map(([name, pts]) => ({ label: name, points: pts.map(q => ({ x: Date.parse(q.ts) / 1000, y: q.value })) }));
    lineChart(document.getElementById("chart-time"), timed.slice(0, 3), { time: true });
  }

  function message(m) {
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content, null, 1);
    return `<div class="turn ${esc(m.role)}"><b>${esc(m.role)}</b><pre>${esc(content)}</pre></div>`;
  }

  async function trajectoryPage(id) {
    const t = await api(`/trajectories/${id}`);
    view.innerHTML = `<p><a href="#/runs/${esc(t.run_id)}">← run</a></p>
      <h2 id="trajectory-title">Trajectory ${esc(t.task_id)} · sample ${t.sample_idx}</h2>
      <div class="cards"><div class="card">reward<b>${num(t.reward)}</b></div>
        <div class="card">termination<b>${esc(t.termination_reason)}</b></div>
        <div class="card">tokens<b>${t.prompt_tokens} / ${t.response_tokens}</b></div>
        <div class="card">policy version<b>${t.policy_version_min}–${t.policy_version_max}</b></div>
        <div class="card">correct<b>${t.episode ? (t.episode.is_correct ? "yes" : "no") : "–"}</b></div></div>
      ${t.steps.map(s => `<div class="step"><h3>turn ${s.step_idx}</h3>
        <p class="meta">reward ${num(s.reward)} · done ${s.done} · tokens ${s.prompt_tokens} / ${s.response_tokens}
          · weights v${s.weight_version ?? "–"} · generation ${num(s.gen_ms, 1)} ms · env ${num(s.env_ms, 1)} ms</p>
        ${(s.chat_completions || []).map(message).join("")}
        <p class="meta">action: <code>${esc(JSON.stringify(s.action))}</code></p></div>`).join("")}`;
  }

  async function route() {
    clearTimeout(timer);
    plots.splice(0).forEach(plot => plot.destroy());
    const [, kind, id] = location.hash.split("/");
    try {
      if (kind === "runs" && id) await runPage(id);
      else if (kind === "trajectories" && id) await trajectoryPage(id);
      else await runsPage();
    } catch (e) {
      view.innerHTML = `<p class="error">${esc(e.message)}</p>`;
    }
  }

  view.addEventListener("click", e => {
    const row = e.target.closest("tr[data-href]");
    if (row) location.hash = row.dataset.href;
  });
  window.addEventListener("hashchange", route);
  route();
})();
