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
      <td>${status(r.status)}${r.error ? ` <span class="error">${esc(r.error)}</span>` : ""}${r.stall_reason ? ` <span class="stall">stalled: ${esc(r.stall_reason)}</span>` : ""}</td><td>${r.policy_version}</td><td>${when(r.created_at)}</td></tr>`).join("")}
      </tbody></table>${runs.length ? "" : "<p>No runs yet: start one with <code>flywheel runs start -f run.yaml</code>.</p>"}`;
  }

  // [key, title, which metric series, run kinds it is drawn for, y axis 0-1 when every value is in 0-1, y axis label]
  const CHARTS = [
    ["reward", "reward over policy versions", m => /(^|\/)reward/.test(m) && !/std/.test(m), ["train"], true],
    ["pass", "pass rate over policy versions", m => /pass/.test(m), ["train"], true],
    ["kl", "KL over policy versions", m => /kl/i.test(m) && !m.startsWith("rollout_corr/"), ["train"], false],
    ["entropy", "entropy over policy versions", m => /entropy/i.test(m), ["train"], false],
    ["throughput", "trainer throughput", m => /throughput|per_s|tokens_s/i.test(m), ["train"], false, "tokens / s"],
    ["time", "reward over time", m => /(^|\/)reward/.test(m) && !/std/.test(m), ["train"], true],
    // |rollout logprob - trainer logprob| on the tokens the trained-from version generated, and the share of
    // truncated IS weights (services/trainer/learner.py: mismatch_metrics), recorded under the step that
    // measured them: step s starts from version s - 1. A share and logprob differences: two panels, two axes.
    ["mismatch", "training-inference mismatch per step (step s measures version s-1)", m => /^logprob_diff_(mean|max)$/.test(m), ["train"], false, "|Δ logprob| (nats)"],
    ["truncated", "IS weights truncated per step (share of tokens)", m => m === "is_truncated_fraction", ["train"], true, "share"],
    // verl's rollout-correction set (services/trainer/algorithm.py: rollout_correction) and its async set
    // (services/trainer/learner.py: async_metrics, rollout_idle_ratio), under verl's own names
    ["iscorr", "rollout correction: IS weights and effective sample size", m => /^rollout_corr\/rollout_is_(mean|std|min|max|eff_sample_size)$/.test(m), ["train"], false, "weight"],
    ["offpolicy", "off-policy gap: rollout vs trainer policy", m => /^rollout_corr\/(kl|k3_kl|chi2_token|chi2_seq|log_ppl_abs_diff)$/.test(m), ["train"], false],
    ["async", "async: idle shares, partial rollouts, rejected tokens", m => /^fully_async\/(trainer\/idle_ratio|rollouter\/idle_ratio|partial\/partial_ratio)$/.test(m) || m === "rollout_corr/rollout_rs_masked_fraction", ["train"], true, "share"],
    ["stale", "stale samples per step and widest version span in a sample", m => /^fully_async\/(count\/stale_samples_processed|partial\/max_partial_span)$/.test(m), ["train"], false, "samples / versions"],
    ["passk", "pass@k", () => false, ["eval"], true],
  ];
  const TERMINATIONS = ["env_done", "max_steps", "prompt_truncation", "response_truncation", "context_exceeded",
    "env_timeout", "timeout", "error", "infra_error", "cancelled", "unknown"];
  const PAGE = 50;  // trajectories per page

  const COLORS = ["#3b82f6", "#22c55e", "#ef4444", "#a855f7", "#f59e0b"];
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];  // versions, steps

  // The y range: 0-1 for a 0-1 quantity (reward, pass rate) whose values all lie in 0-1; a band around a flat
  // series (uPlot's default turns an all-zero series into 0-100 and a flat 6.231 into ticks that all read
  // "6.231"); else the data with a margin, never below 0 for data that is not.
  function yRange(values, unit) {
    const lo = Math.min(...values), hi = Math.max(...values);
    if (unit && lo >= 0 && hi <= 1) return [0, 1];
    if (hi - lo <= 1e-9 * Math.max(1, Math.abs(hi))) {
      if (lo === 0) return [0, 1];
      const d = Math.abs(lo) * 0.2;
      return [lo - d, hi + d];
    }
    const pad = (hi - lo) * 0.1;
    return [lo >= 0 && lo - pad < 0 ? 0 : lo - pad, hi + pad];
  }

  // Tick labels with as many decimals as the tick spacing needs (0.25 needs 2), so neighbouring ticks never
  // read the same.
  function tickLabels(splits, incr) {
    let decimals = 0;
    while (decimals < 12 && Math.abs(Math.round(incr * 10 ** decimals) - incr * 10 ** decimals) > 1e-6) decimals++;
    return splits.map(v => (v === null ? "" : Math.abs(v) >= 1e6 ? v.toExponential(2) : v.toFixed(decimals)));
  }

  // A line chart in `el` of series [{label, points: [{x, y}]}] (x: a number, or seconds since the epoch with
  // opts.time). uPlot wants one shared x array: the union of every series' x, null where a series has no point.
  // For the browser test: el.dataset.points (points drawn), yRange ("lo,hi") and yTicks (labels, "|"-joined).
  // opts.ended: the run is over, so a chart without data says so instead of "no data yet". Every legend entry
  // has a line of its own: a series without a point has none, and series with the same points (kl_ref and
  // kl_behaviour both 0) are one line under one entry, "a = b" (el.dataset.legend: the entries drawn).
  function lineChart(el, series, opts = {}) {
    const lines = [];
    for (const s of series) {
      const points = s.points.filter(p => Number.isFinite(p.x) && Number.isFinite(p.y));
      const key = JSON.stringify(points.map(p => [p.x, p.y]));
      const same = lines.find(l => l.key === key);
      if (!points.length) continue;
      if (same) same.label += ` = ${s.label}`;
      else lines.push({ label: s.label, points, key });
    }
    const count = lines.reduce((n, s) => n + s.points.length, 0);
    el.dataset.points = String(count);
    el.dataset.legend = lines.map(s => s.label).join("|");
    el.dataset.yLabel = opts.yLabel || "";  // drawn on the canvas: kept here for the browser test
    if (!count) {
      el.innerHTML = `<p class="empty">${opts.ended ? opts.noData || "no data: the run ended before any was recorded" : "no data yet"}</p>`;
      return;
    }
    const xs = [...new Set(lines.flatMap(s => s.points.map(p => p.x)))].sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const ys = lines.map(s => {
      const column = xs.map(() => null);
      s.points.forEach(p => { column[index.get(p.x)] = p.y; });
      return column;
    });
    const [yMin, yMax] = yRange(lines.flatMap(s => s.points.map(p => p.y)), opts.unit);
    el.dataset.yRange = `${yMin},${yMax}`;
    const pad = opts.time ? 60 : 1;  // a single x value (one version so far) still gets an axis around it
    plots.push(new uPlot({
      width: el.clientWidth || 360, height: 220, legend: { live: false },
      scales: {
        x: { time: !!opts.time, range: (u, lo, hi) => (xs.length === 1 ? [xs[0] - pad, xs[0] + pad] : [lo, hi]) },
        y: { range: () => [yMin, yMax] },
      },
      axes: [{ label: opts.xLabel, ...(opts.time ? {} : { incrs: opts.xIncrs || INTEGER_STEPS }) },
        { size: 60, space: 30, label: opts.yLabel, values: (u, splits, axis, space, incr) => {
          const labels = tickLabels(splits, incr);
          el.dataset.yTicks = labels.join("|");
          return labels;
        } }],
      series: [{ label: opts.xLabel }, ...lines.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { size: 5 },
      }))],
    }, [xs, ...ys], el));
  }

  // The run page: #run-main (status, cards, charts) is redrawn every 3 s while the run goes; #traj-section
  // (filters, one page of trajectories) keeps its form, and only its rows are refreshed.
  async function runPage(id, query, refresh = false) {
    const at = location.hash;
    if (!refresh) view.innerHTML = `<div id="run-main"><p>loading…</p></div><section id="traj-section"></section>`;
    const [run, metrics, rewards] = await Promise.all([api(`/runs/${id}`), api(`/runs/${id}/metrics`), api(`/runs/${id}/rewards`)]);
    const main = document.getElementById("run-main");
    if (!main || location.hash !== at) return;  // the user went elsewhere meanwhile
    plots.splice(0).forEach(plot => plot.destroy());
    const u = run.ledger.units, a = run.ledger.attempts, p = run.progress;
    const ended = ["stopped", "completed", "failed"].includes(run.status);
    const charts = CHARTS.filter(c => c[3].includes(run.kind));
    main.innerHTML = `<h2>${esc(run.name)} ${status(run.status)}</h2>
      <p class="meta">${esc(run.kind)} run ${esc(run.id)} · model ${esc(run.config.model)}${run.config.dataset ? ` · dataset ${esc(run.config.dataset)}` : ""}
        · created ${when(run.created_at)}</p>
      ${run.error ? `<p class="error" id="run-error">${esc(run.error)}</p>` : ""}
      ${run.stall_reason ? `<p class="stall" id="run-stall">stalled${run.stalled_since ? ` since ${when(run.stalled_since)}` : ""}: ${esc(run.stall_reason)}</p>` : ""}
      ${run.warning ? `<p class="stall" id="run-warning">warning: ${esc(run.warning)}</p>` : ""}
      <div class="progress" title="progress"><div style="width:${Math.round((p.fraction || 0) * 100)}%"></div></div>
      <div class="cards" id="ledger">
        <div class="card">policy version<b>${run.policy_version}</b></div>
        <div class="card">progress (${esc(p.unit)})<b>${p.done}${p.total !== null ? " / " + p.total : ""}</b></div>
        <div class="card" title="(task, sample) units with a scored result; all units add up to ${u.total}">samples scored<b>${u.completed}</b></div>
        <div class="card" title="the user's env, reward function, agent, workflow or agent program failed: not scored">samples errored<b>${u.errored}</b></div>
        <div class="card" title="infrastructure failures, out of attempts">samples failed<b>${u.failed}</b></div>
        <div class="card">samples in flight<b>${u.in_flight + u.retrying}</b></div>
        ${u.cancelled ? `<div class="card">samples cancelled<b>${u.cancelled}</b></div>` : ""}
        ${run.tool_call_errors ? `<div class="card" id="tool-call-errors" title="not JSON, an unknown tool or wrong arguments: each an error observation the agent saw">malformed tool calls<b>${run.tool_call_errors}</b></div>` : ""}
        ${run.context_rewrites ? `<div class="card" id="context-rewrites" title="turns after which an agent summarized or dropped its history: each starts a new training sequence of its trajectory">context rewrites<b>${run.context_rewrites}</b></div>` : ""}
        <div class="card" title="completed ${a.completed}, errored ${a.errored}, failed ${a.failed}, lost ${a.lost}, cancelled ${a.cancelled}">attempts<b>${a.total}</b></div>
        ${Object.entries(run.pass_at_k || {}).map(([k, v]) => `<div class="card" title="over the ${u.completed} scored samples">${esc(k)}<b>${num(v)}</b></div>`).join("")}
        ${run.kind === "eval" ? evalCards(rewards.data) : ""}
      </div>
      ${run.ledger.top_reasons.length ? `<table id="reasons"><thead><tr><th>outcome</th><th>units</th><th>attempts</th>
        <th>why units ended unscored</th></tr></thead><tbody>${run.ledger.top_reasons.map(r => `<tr><td>${esc(r.outcome)}</td>
        <td>${r.units}</td><td>${r.attempts}</td><td>${esc(r.reason)}</td></tr>`).join("")}</tbody></table>` : ""}
      <div class="charts">${charts.map(([key, title]) => `<div class="chart"><h3>${title}</h3><div class="plot" id="chart-${key}"></div></div>`).join("")}</div>`;
    drawRunCharts(run, charts, metrics.series, rewards.data, ended);
    if (!refresh) trajectoryFilters(id, query);
    await trajectoryRows(id, query);
    if (!ended) timer = setTimeout(() => runPage(id, query, true).catch(showError), 3000);
  }

  // An evaluation's samples all come from one model: its mean reward and pass rate are numbers, not curves.
  function evalCards(rewards) {
    const n = rewards.reduce((t, r) => t + r.num_trajectories, 0);
    const mean = key => (n ? rewards.reduce((t, r) => t + (r[key] ?? 0) * r.num_trajectories, 0) / n : null);
    return `<div class="card">mean reward<b id="eval-mean-reward">${num(mean("mean_reward"))}</b></div>
      <div class="card">pass rate<b id="eval-pass-rate">${num(mean("pass_rate"))}</b></div>`;
  }

  function drawRunCharts(run, charts, series, rewards, ended) {
    const byVersion = key => rewards.map(r => ({ x: r.policy_version, y: r[key] })).filter(q => q.x !== null);
    for (const [key, , match, , unit, yLabel] of charts) {
      const el = document.getElementById(`chart-${key}`);
      if (key === "passk") {  // pass@k against k, from the run's stored samples
        const points = Object.entries(run.pass_at_k || {}).map(([k, v]) => ({ x: +k.replace("pass@", ""), y: v }));
        lineChart(el, [{ label: "pass@k", points }], { xLabel: "k (samples per task)", unit, ended, xIncrs: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024] });
        continue;
      }
      if (key === "time") {
        const timed = Object.entries(series).filter(([name]) => match(name))
          .map(([name, pts]) => ({ label: name, points: pts.map(q => ({ x: Date.parse(q.ts) / 1000, y: q.value })) }));
        lineChart(el, timed.slice(0, 3), { time: true, unit, ended });
        continue;
      }
      const lines = Object.entries(series).filter(([name]) => match(name))
        .map(([name, pts]) => ({ label: name, points: pts.map(q => ({ x: q.step, y: q.value })) }));
      if (key === "reward") lines.unshift({ label: "mean reward (trajectories)", points: byVersion("mean_reward") });
      if (key === "pass") lines.unshift({ label: "pass rate (trajectories)", points: byVersion("pass_rate") });
      lineChart(el, lines.slice(0, 4), { xLabel: ["throughput", "mismatch", "truncated"].includes(key) ? "step" : "policy version",
        unit, ended, yLabel });
    }
  }

  // Trajectory filters live in the page address (#/runs/<id>?task_id=...&offset=50): shareable, and the back
  // button undoes a filter. The API filters and pages (GET /v1/runs/{id}/trajectories).
  const FILTERS = ["policy_version", "task_id", "termination_reason", "min_reward", "max_reward"];

  function trajectoryFilters(id, query) {
    const q = new URLSearchParams(query);
    const input = (name, label, attrs = "") => `<label>${label} <input name="${name}" value="${esc(q.get(name) || "")}" ${attrs}></label>`;
    document.getElementById("traj-section").innerHTML = `<h3>Trajectories (<span id="traj-count">…</span>)</h3>
      <form id="traj-filter" class="filters">
        ${input("policy_version", "policy version", 'type="number" min="0" step="1" class="short"')}
        ${input("task_id", "task")}
        <label>termination <select name="termination_reason"><option value="">any</option>${TERMINATIONS.map(t =>
          `<option${q.get("termination_reason") === t ? " selected" : ""}>${t}</option>`).join("")}</select></label>
        ${input("min_reward", "reward ≥", 'type="number" step="any" class="short"')}
        ${input("max_reward", "reward ≤", 'type="number" step="any" class="short"')}
        <button>filter</button> <a href="#/runs/${esc(id)}" id="traj-clear">clear</a>
      </form>
      <table id="trajectories"><thead><tr><th>task</th><th>sample</th><th>reward</th><th>termination</th><th>steps</th>
        <th>tokens (prompt / response)</th><th>policy version</th></tr></thead><tbody></tbody></table>
      <div class="pager" id="traj-pager"></div>`;
    document.getElementById("traj-filter").addEventListener("submit", e => {
      e.preventDefault();
      const next = new URLSearchParams();
      for (const [k, v] of new FormData(e.target)) if (String(v).trim()) next.set(k, String(v).trim());
      location.hash = `#/runs/${id}` + (next.toString() ? "?" + next : "");
    });
  }

  async function trajectoryRows(id, query) {
    const q = new URLSearchParams(query);
    const offset = Math.max(0, parseInt(q.get("offset") || "0", 10) || 0);
    const params = new URLSearchParams({ limit: String(PAGE), offset: String(offset) });
    FILTERS.forEach(k => { if (q.get(k)) params.set(k, q.get(k)); });
    const body = document.querySelector("#trajectories tbody");
    let trajs;
    try {
      trajs = await api(`/runs/${id}/trajectories?${params}`);
    } catch (e) {  // a bad filter (e.g. a negative version) is shown under the form, the page stays
      if (body) body.innerHTML = `<tr><td colspan="7" class="error">${esc(e.message)}</td></tr>`;
      return;
    }
    if (!body) return;
    body.innerHTML = trajs.data.map(t => `
        <tr class="link" data-href="#/trajectories/${esc(t.id)}"><td>${esc(t.task_id)}</td><td>${t.sample_idx}</td>
        <td>${num(t.reward)}</td><td>${esc(t.termination_reason)}</td><td>${t.num_steps}</td>
        <td>${t.prompt_tokens} / ${t.response_tokens}</td><td>${versions(t)}</td></tr>`).join("")
      || `<tr><td colspan="7" class="meta">no trajectories${FILTERS.some(k => q.get(k)) ? " match these filters" : " yet"}</td></tr>`;
    document.getElementById("traj-count").textContent = String(trajs.count);
    const page = o => { const n = new URLSearchParams(q); n.set("offset", String(o)); return `#/runs/${esc(id)}?${n}`; };
    const last = Math.max(0, Math.floor((trajs.count - 1) / PAGE) * PAGE);
    const link = (cond, o, text, idAttr) => (cond ? `<a href="${page(o)}" id="${idAttr}">${text}</a>` : `<span class="off">${text}</span>`);
    document.getElementById("traj-pager").innerHTML = trajs.count === 0 ? "" : `
      ${link(offset > 0, 0, "« newest", "traj-first")} ${link(offset > 0, Math.max(0, offset - PAGE), "‹ newer", "traj-prev")}
      <span id="traj-range">${Math.min(offset + 1, trajs.count)}–${Math.min(offset + trajs.data.length, trajs.count)} of ${trajs.count}</span>
      ${link(offset + PAGE < trajs.count, offset + PAGE, "older ›", "traj-next")} ${link(offset < last, last, "oldest »", "traj-last")}`;
  }

  // "16" for a trajectory one version generated, "15–16" across a hot reload.
  function versions(t) {
    return t.policy_version_min === t.policy_version_max ? `${t.policy_version_min ?? "–"}` : `${t.policy_version_min}–${t.policy_version_max}`;
  }

  // A step's messages with the model's answer: an agent that keeps only the prompt in chat_completions (a
  // one-token answer) still shows what the model said.
  function withAnswer(s) {
    const msgs = s.chat_completions || [];
    const answered = msgs.some(m => m.role === "assistant");
    return answered || s.model_response == null ? msgs : [...msgs, { role: "assistant", content: s.model_response }];
  }

  function message(m) {
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content, null, 1);
    return `<div class="turn ${esc(m.role)}"><b>${esc(m.role)}</b><pre>${esc(content)}</pre></div>`;
  }

  // The unit's life from what was stored: the queue wait (dispatch to start), each turn's generation and env
  // step (gen_ms, env_ms) from the start, and the store (finish to commit); the trace in Jaeger when one exists.
  function timeline(t) {
    const tl = t.timeline;
    if (!tl || !tl.started_at) return "";
    const ms = s => (s ? Date.parse(s) : null);
    const start = ms(tl.started_at), t0 = ms(tl.dispatched_at) ?? start;
    const segs = tl.dispatched_at ? [["queue", t0, start]] : [];
    // the whole rollout under its turns: what the turns leave uncovered is the worker's own time (env reset,
    // the agent's code, tokenization, the wait for an engine slot)
    if (tl.finished_at) segs.push(["rollout", start, ms(tl.finished_at)]);
    let at = start;
    for (const s of t.steps) {
      segs.push([`turn ${s.step_idx} generation`, at, (at += s.gen_ms)]);
      segs.push([`turn ${s.step_idx} env`, at, (at += s.env_ms)]);
    }
    if (tl.finished_at && tl.stored_at) segs.push(["store", ms(tl.finished_at), ms(tl.stored_at)]);
    const total = Math.max(...segs.map(g => g[2]), ms(tl.finished_at) ?? at) - t0 || 1;
    const pct = v => (100 * v / total).toFixed(2);
    const bar = ([label, a, b]) => `<div class="seg ${label.split(" ").pop()}" style="left:${pct(a - t0)}%;width:${Math.max(0.3, pct(b - a))}%" title="${esc(label)}: ${num(b - a, 1)} ms"></div>`;
    const sum = kind => segs.filter(g => g[0].endsWith(kind)).reduce((n, g) => n + g[2] - g[1], 0);
    const other = Math.max(0, sum("rollout") - sum("generation") - sum("env"));
    const parts = [["queue", sum("queue")], ["generation", sum("generation")], ["env", sum("env")],
                   ["rollout", other, "worker (reset, agent, tokenizer)"], ["store", sum("store")]];
    const legend = parts.map(([k, v, label]) => `<span class="key"><i class="swatch seg ${k}"></i>${label || k} ${num(v, 1)} ms</span>`).join("");
    const trace = !tl.trace_id ? "" : tl.trace_url
      ? ` · <a id="trace-link" href="${esc(tl.trace_url)}" target="_blank" rel="noopener">trace ${esc(tl.trace_id)}</a>`
      : ` · trace ${esc(tl.trace_id)}`;
    return `<h3>timeline</h3><div id="timeline" class="timeline">${segs.map(bar).join("")}</div>
      <p class="meta timeline-legend" id="timeline-legend">${legend}</p>
      <p class="meta" id="timeline-note">${num(total, 0)} ms: queue ${num(sum("queue"), 1)} ms · generation ${num(sum("generation"), 1)} ms
        · env ${num(sum("env"), 1)} ms · worker ${num(other, 1)} ms · store ${num(sum("store"), 1)} ms${trace}</p>`;
  }

  async function trajectoryPage(id) {
    const t = await api(`/trajectories/${id}`);
    view.innerHTML = `<p><a href="#/runs/${esc(t.run_id)}">← run</a></p>
      <h2 id="trajectory-title">Trajectory ${esc(t.task_id)} · sample ${t.sample_idx}</h2>
      <div class="cards"><div class="card">reward<b>${num(t.reward)}</b></div>
        <div class="card" title="why the trajectory ended; response_truncation: the answer used all of max_response_tokens (a one-token answer always does), which says nothing about whether it was right">termination<b>${esc(t.termination_reason)}</b>${t.termination_reason === "response_truncation" ? `<span class="meta" id="termination-note">max_response_tokens reached</span>` : ""}</div>
        <div class="card">tokens<b>${t.prompt_tokens} / ${t.response_tokens}</b></div>
        <div class="card">policy version<b id="trajectory-versions">${versions(t)}</b></div>
        <div class="card">correct<b>${t.episode ? (t.episode.is_correct ? "yes" : "no") : "–"}</b></div></div>
      ${timeline(t)}
      ${t.steps.map(s => `<div class="step"><h3>turn ${s.step_idx}</h3>
        <p class="meta">reward ${num(s.reward)} · done ${s.done} · tokens ${s.prompt_tokens} / ${s.response_tokens}
          · weights v${s.weight_version ?? "–"} · generation ${num(s.gen_ms, 1)} ms · env ${num(s.env_ms, 1)} ms</p>
        ${withAnswer(s).map(message).join("")}
        <p class="meta">action: <code>${esc(JSON.stringify(s.action))}</code></p></div>`).join("")}`;
  }

  function showError(e) {
    view.innerHTML = `<p class="error">${esc(e.message)}</p>`;
  }

  async function route() {
    clearTimeout(timer);
    plots.splice(0).forEach(plot => plot.destroy());
    const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
    const [, kind, id] = path.split("/");
    try {
      if (kind === "runs" && id) await runPage(id, query);
      else if (kind === "trajectories" && id) await trajectoryPage(id);
      else await runsPage();
    } catch (e) {
      showError(e);
    }
  }

  view.addEventListener("click", e => {
    const row = e.target.closest("tr[data-href]");
    if (row) location.hash = row.dataset.href;
  });
  window.addEventListener("hashchange", route);
  route();
})();
