"""The status page served at ``/``: one self-contained HTML document.

No CDN, no build step: the CSS and the JavaScript are inline and the charts are drawn on
``<canvas>`` by the small functions below. Every 2 s the page fetches ``/v1/status`` and
``/v1/discrepancy`` and redraws: versions by state, services up/down with the age of
their last heartbeat, mean and P99 |Δ log p| over time per (learner, sampler) path pair,
clip potential and TIS truncation, and the guidance store's bytes against its budget.
The history behind the charts lives only in the page (the last :data:`POINTS` polls).

It renders with zero data as well: empty tables say so, charts draw their axes and "no
data yet". After each successful refresh ``<body>`` carries ``data-rendered`` (the count
of refreshes) and ``#updated`` the time, which is what a headless browser test checks;
a failed fetch shows its error in ``#error`` and keeps the last data on screen.
"""

from __future__ import annotations

#: Polls of history kept for the charts (2 s apart: ten minutes).
POINTS = 300

STATUS_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>libalign status</title>
<style>
  :root { --fg:#1d2330; --mute:#6b7383; --line:#d9dee7; --bg:#f6f7fa; --card:#fff;
          --ok:#1f8f4e; --bad:#c23a2b; --warn:#b7791f; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
         color:var(--fg); background:var(--bg); }
  header { display:flex; align-items:baseline; gap:1rem; padding:.8rem 1.2rem;
           background:var(--card); border-bottom:1px solid var(--line); }
  header h1 { font-size:1.1rem; margin:0; }
  header .mute { color:var(--mute); font-size:.85rem; }
  #error { color:var(--bad); font-size:.85rem; }
  main { display:grid; grid-template-columns:repeat(auto-fit, minmax(340px, 1fr)); gap:1rem;
         padding:1rem 1.2rem; }
  section { background:var(--card); border:1px solid var(--line); border-radius:6px;
            padding:.8rem 1rem; min-width:0; }
  section.wide { grid-column:1 / -1; }
  h2 { font-size:.95rem; margin:0 0 .6rem; }
  table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
  th, td { text-align:left; padding:.25rem .4rem; border-bottom:1px solid var(--line); }
  th { color:var(--mute); font-weight:500; font-size:.8rem; }
  td.num { text-align:right; }
  .up { color:var(--ok); font-weight:600; } .down { color:var(--bad); font-weight:600; }
  .empty { color:var(--mute); font-style:italic; }
  canvas { width:100%; height:220px; display:block; }
  .kv { display:grid; grid-template-columns:auto 1fr; gap:.2rem 1rem; }
  .kv div:nth-child(odd) { color:var(--mute); }
  .bar { height:10px; background:var(--line); border-radius:5px; overflow:hidden; }
  .bar > div { height:100%; background:var(--ok); width:0; }
  .legend span { display:inline-block; margin-right:1rem; font-size:.8rem; }
  .legend i { display:inline-block; width:10px; height:10px; margin-right:.3rem;
              border-radius:2px; vertical-align:middle; }
</style>
</head>
<body data-rendered="0">
<header>
  <h1>libalign</h1>
  <span class="mute">learner &harr; sampler alignment</span>
  <span class="mute">updated <span id="updated">never</span></span>
  <span id="error"></span>
</header>
<main>
  <section id="versions-section">
    <h2>Weight versions</h2>
    <table><thead><tr><th>state</th><th class="num">count</th><th>latest</th></tr></thead>
      <tbody id="versions"></tbody></table>
    <p class="mute" id="lag">version lag: &ndash;</p>
  </section>
  <section id="services-section">
    <h2>Services</h2>
    <table><thead><tr><th>service</th><th>name</th><th>state</th><th>version</th>
      <th class="num">age</th></tr></thead><tbody id="services"></tbody></table>
  </section>
  <section id="discrepancy-section">
    <h2>Discrepancy now</h2>
    <div class="kv" id="discrepancy"></div>
  </section>
  <section id="guidance-section">
    <h2>Guidance store</h2>
    <div class="kv" id="guidance"></div>
    <div class="bar" title="bytes used of the budget"><div id="guidance-bar"></div></div>
  </section>
  <section class="wide" id="delta-section">
    <h2>|&Delta; log p| over time per path (solid: P99, dashed: mean)</h2>
    <canvas id="delta-chart" width="1000" height="220"></canvas>
    <div class="legend" id="delta-legend"></div>
  </section>
  <section class="wide" id="clip-section">
    <h2>Clip potential and TIS truncation (fraction of window tokens)</h2>
    <canvas id="clip-chart" width="1000" height="220"></canvas>
    <div class="legend" id="clip-legend"></div>
  </section>
</main>
<script>
"use strict";
const POINTS = __POINTS__;
const COLORS = ["#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f", "#2c7a7b"];
const history = { t: [], series: {} };   // series[name] = array aligned with t (null = gap)
let rendered = 0;

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "\u2013";
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (a < 1e-3 || a >= 1e5) return x.toExponential(digits || 2);
  return x.toFixed(digits || 4);
}
function bytes(n) {
  if (n === null || n === undefined) return "\u2013";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0; while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}
function fill(tbody, rows, cols, emptyText) {
  tbody.replaceChildren();
  if (!rows.length) {
    const tr = el("tr"); const td = el("td", { colspan: cols, class: "empty" }, emptyText);
    tr.appendChild(td); tbody.appendChild(tr); return;
  }
  for (const r of rows) {
    const tr = el("tr");
    for (const c of r) tr.appendChild(c instanceof Node ? c : el("td", {}, c));
    tbody.appendChild(tr);
  }
}
function kv(box, pairs) {
  box.replaceChildren();
  for (const [k, v] of pairs) { box.appendChild(el("div", {}, k)); box.appendChild(el("div", {}, v)); }
}

function renderVersions(s) {
  const rows = Object.keys(s.versions_by_state).map(function (st) {
    return [st, el("td", { class: "num" }, s.versions_by_state[st]), s.latest[st] || "\u2013"];
  });
  fill(document.getElementById("versions"), rows, 3, "no versions yet");
  document.getElementById("lag").textContent = "version lag: " + s.weight_version_lag;
}
function renderServices(s) {
  const rows = s.services.map(function (x) {
    const state = el("td", { class: x.up ? "up" : "down" }, (x.up ? "up" : "down") + " \u00b7 " + x.state);
    return [x.service, x.name, state, x.version || "\u2013",
            el("td", { class: "num" }, x.age_s === null ? "\u2013" : x.age_s.toFixed(1) + " s")];
  });
  fill(document.getElementById("services"), rows, 5, "no service has reported yet");
}
function renderDiscrepancy(d) {
  const s = d.stats;
  kv(document.getElementById("discrepancy"), [
    ["tokens in window", s.count + " / " + d.window_tokens],
    ["versions", d.versions.length ? d.versions.slice(0, 3).join(", ") +
      (d.versions.length > 3 ? " (+" + (d.versions.length - 3) + " more)" : "") : "\u2013"],
    ["mean |\u0394|", fmt(s.mean_abs)], ["P99 |\u0394|", fmt(s.p99_abs)],
    ["max |\u0394|", fmt(s.max_abs)],
    ["clip potential", fmt(s.clip_potential)], ["TIS truncated", fmt(s.tis_truncated_fraction)],
    ["k3 KL", fmt(s.k3_kl)],
  ]);
}
function renderGuidance(g) {
  kv(document.getElementById("guidance"), [
    ["stored", bytes(g.stored_bytes)], ["budget", g.budget_bytes ? bytes(g.budget_bytes) : "none"],
    ["versions", g.versions], ["rollouts", g.rollouts],
    ["leased", g.leased_versions.length ? g.leased_versions.join(", ") : "\u2013"],
  ]);
  const used = g.budget_used_ratio === null ? 0 : Math.min(1, g.budget_used_ratio);
  document.getElementById("guidance-bar").style.width = (100 * used).toFixed(1) + "%";
}

function record(now, values) {
  history.t.push(now);
  for (const name in history.series) history.series[name].push(null);
  for (const name in values) {
    if (!history.series[name]) history.series[name] = new Array(history.t.length).fill(null);
    history.series[name][history.t.length - 1] = values[name];
  }
  while (history.t.length > POINTS) {
    history.t.shift();
    for (const name in history.series) history.series[name].shift();
  }
}

// A line chart of the series whose names pass `pick`, on one linear y axis from 0.
function chart(canvasId, legendId, pick, styleOf) {
  const cv = document.getElementById(canvasId);
  const ctx = cv.getContext("2d");
  const W = cv.width, H = cv.height, L = 64, R = 12, T = 10, B = 24;
  ctx.clearRect(0, 0, W, H);
  const names = Object.keys(history.series).filter(pick).sort();
  let ymax = 0;
  for (const n of names) for (const v of history.series[n]) if (v !== null && v > ymax) ymax = v;
  const hasData = function (n) { return history.series[n].some(function (v) { return v !== null; }); };
  const empty = !names.some(hasData);
  if (ymax <= 0) ymax = 1;
  ymax *= 1.1;
  ctx.strokeStyle = "#d9dee7"; ctx.fillStyle = "#6b7383"; ctx.font = "11px sans-serif";
  ctx.lineWidth = 1; ctx.setLineDash([]);
  for (let i = 0; i <= 4; i++) {
    const y = T + (H - T - B) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(W - R, y); ctx.stroke();
    ctx.fillText(fmt(ymax * i / 4, 2), 4, y + 4);
  }
  const n = history.t.length;
  if (n > 1) {
    const span = (history.t[n - 1] - history.t[0]) / 1000;
    ctx.fillText("-" + span.toFixed(0) + " s", L, H - 6);
    ctx.fillText("now", W - R - 24, H - 6);
  }
  const legend = document.getElementById(legendId);
  legend.replaceChildren();
  if (empty) {
    ctx.fillStyle = "#6b7383"; ctx.font = "14px sans-serif";
    ctx.fillText("no data yet", W / 2 - 40, H / 2);
    legend.appendChild(el("span", { class: "empty" }, "no data yet"));
    return;
  }
  const x = function (i) { return L + (W - L - R) * (n > 1 ? i / (n - 1) : 1); };
  const y = function (v) { return T + (H - T - B) * (1 - v / ymax); };
  names.forEach(function (name) {
    const st = styleOf(name);
    ctx.strokeStyle = st.color; ctx.lineWidth = 2; ctx.setLineDash(st.dash || []);
    ctx.beginPath();
    let pen = false;
    history.series[name].forEach(function (v, i) {
      if (v === null) { pen = false; return; }
      if (pen) ctx.lineTo(x(i), y(v)); else { ctx.moveTo(x(i), y(v)); pen = true; }
      if (n === 1) ctx.arc(x(i), y(v), 2, 0, 2 * Math.PI);
    });
    ctx.stroke();
    const item = el("span", { "data-series": name });
    const sw = el("i"); sw.style.background = st.color;
    item.appendChild(sw); item.appendChild(document.createTextNode(name));
    legend.appendChild(item);
  });
  ctx.setLineDash([]);
}
const pairColors = {};
function colorOf(pair) {
  if (!(pair in pairColors)) pairColors[pair] = COLORS[Object.keys(pairColors).length % COLORS.length];
  return pairColors[pair];
}
// style of a series: the pair's color, dashed when its statistic is `kind`
function dashed(kind) {
  return function (name) {
    const [pair, k] = splitName(name);
    return { color: colorOf(pair), dash: k === kind ? [5, 4] : [] };
  };
}
function splitName(name) { const i = name.lastIndexOf(" "); return [name.slice(0, i), name.slice(i + 1)]; }

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) {
    throw new Error(url + ": " + (body.error ? body.error.code + ": " + body.error.message : r.status));
  }
  return body;
}
async function refresh() {
  try {
    const [s, d] = await Promise.all([getJSON("/v1/status"), getJSON("/v1/discrepancy")]);
    renderVersions(s); renderServices(s); renderDiscrepancy(d); renderGuidance(s.guidance);
    const values = {};
    for (const p of d.by_path) {
      const pair = p.learner_path + "/" + p.sampler_path;
      values[pair + " p99"] = p.stats.p99_abs; values[pair + " mean"] = p.stats.mean_abs;
      values[pair + " clip"] = p.stats.clip_potential; values[pair + " tis"] = p.stats.tis_truncated_fraction;
    }
    record(Date.now(), values);
    chart("delta-chart", "delta-legend",
          function (n) { return n.endsWith(" p99") || n.endsWith(" mean"); }, dashed("mean"));
    chart("clip-chart", "clip-legend",
          function (n) { return n.endsWith(" clip") || n.endsWith(" tis"); }, dashed("tis"));
    document.getElementById("error").textContent = "";
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    rendered += 1;
    document.body.setAttribute("data-rendered", String(rendered));
  } catch (e) {
    document.getElementById("error").textContent = String(e.message || e);
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
""".replace("__POINTS__", str(POINTS))
