// Echo swarm dashboard: reads the coordinator's server-sent events and draws them.
// No build step: plain browser JavaScript, with uPlot (vendored beside this file) for the charts.
// Every text that came from the coordinator goes into the page as text (textContent), never as
// HTML: job names, node ids and reasons are other people's input.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { token: sessionStorage.getItem("echo-token") || "", job: null, charts: {}, last: null };

// ---------------------------------------------------------------- server-sent events over fetch
// EventSource cannot send an Authorization header, so the stream is read with fetch and parsed
// here (the same wire format: "event:" and "data:" lines, a blank line ends an event).
function stream(url, headers, onEvent, onStatus) {
  const ctl = new AbortController();
  let stopped = false;
  async function run() {
    while (!stopped) {
      try {
        const resp = await fetch(url, { headers, signal: ctl.signal, cache: "no-store" });
        if (resp.status === 401) { onStatus("unauthorized"); return; }
        if (!resp.ok) throw new Error("HTTP " + resp.status);
        onStatus("live");
        const reader = resp.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            let event = "message", data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("event:")) event = line.slice(6).trim();
              else if (line.startsWith("data:")) data += line.slice(5).trimStart();
            }
            if (data) onEvent(event, JSON.parse(data));
          }
        }
      } catch (err) {
        if (stopped) return;
        onStatus("reconnecting");
      }
      await new Promise((r) => setTimeout(r, 3000));
    }
  }
  run();
  return () => { stopped = true; ctl.abort(); };
}

// ---------------------------------------------------------------- small DOM helpers
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text == null ? "–" : String(text);
  if (cls) td.className = cls;
  return td;
}
function fillTable(sel, rows) {
  const body = $(sel + " tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}
const short = (id) => (id && id.length > 14 ? "…" + id.slice(-12) : id);
const num = (x, d = 1) => (x == null ? "–" : Number(x).toFixed(d));
function ago(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}
function rate(bps) {
  if (bps == null) return "";
  return bps >= 1e6 ? (bps / 1e6).toFixed(1) + " MB/s" : (bps / 1e3).toFixed(0) + " kB/s";
}

// ---------------------------------------------------------------- public part
function renderPublic(snap) {
  $("#swarm-size").textContent = `${snap.nodes_active} nodes active, ${snap.jobs_running} jobs running`;
  fillTable("#leaderboard", snap.leaderboard.map((r, i) => [
    cell(i + 1), cell(short(r.node_id)), cell(num(r.credits, 3), "num"), cell(r.entries, "num")]));
  if ($("#node-id").value.trim()) showNode($("#node-id").value.trim());
}

async function showNode(id) {
  const out = $("#my-node");
  const [node, credit] = await Promise.all([
    fetch("/v1/public/nodes/" + encodeURIComponent(id)).then((r) => (r.ok ? r.json() : null)),
    fetch("/v1/credit/" + encodeURIComponent(id) + "?limit=1000").then((r) => (r.ok ? r.json() : null)),
  ]);
  const parts = [];
  const p = (text, cls) => { const e = document.createElement("p"); e.textContent = text; if (cls) e.className = cls; parts.push(e); };
  if (!node) p("This coordinator does not know that node.", "bad");
  else p(`${node.engine}, ${node.reachability}, ${num(node.tokens_per_s, 0)} tok/s, version ${node.version}, ` +
         `last seen ${ago(node.last_seen)}; ${node.accepted} groups accepted, ${node.rejected} rejected` +
         (node.excluded ? " (excluded)" : ""));
  if (credit) {
    p(`Credit: ${num(credit.credits, 6)} (${credit.entries_total} signed entries)`, "ok");
    const t = document.createElement("table");
    t.innerHTML = "<thead><tr><th>#</th><th>for</th><th>job</th><th>version</th><th>credits</th></tr></thead><tbody></tbody>";
    parts.push(t);
    t.tBodies[0].replaceChildren(...credit.entries.slice(-15).reverse().map((e) => {
      const tr = document.createElement("tr");
      tr.append(cell(e.seq), cell(e.kind), cell(short(e.job_id)), cell(e.version), cell(num(e.amount / 1e6, 6), "num"));
      return tr;
    }));
    if (credit.recent_rejections.length) {
      p("Recent rejections (rejected work earns nothing):", "bad");
      const r = document.createElement("table");
      r.innerHTML = "<thead><tr><th>when</th><th>reason</th><th>job</th></tr></thead><tbody></tbody>";
      r.tBodies[0].replaceChildren(...credit.recent_rejections.map((x) => {
        const tr = document.createElement("tr");
        tr.append(cell(ago(x.at)), cell(x.reason), cell(short(x.job_id)));
        return tr;
      }));
      parts.push(r);
    }
  }
  out.replaceChildren(...parts);
}

// ---------------------------------------------------------------- operator part
function chart(key, el, series, data, opts = {}) {
  const width = Math.max(300, el.clientWidth || 460);
  let c = state.charts[key];
  const names = series.map((s) => s.label).join("|");
  if (!c || c._names !== names) {
    if (c) c.destroy();
    el.replaceChildren();
    const y = opts.zero ? { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } : {};
    c = new uPlot({ width, height: 220, scales: { x: { time: !!opts.time }, y }, series: [{}, ...series],
      axes: [{}, { size: 50 }] }, data, el);
    c._names = names;
    state.charts[key] = c;
  } else {
    c.setData(data);
  }
}

const COLORS = ["#2f6fde", "#e0732b", "#2e9e5b", "#b3261e", "#7b4fc9", "#c9a21f", "#138a8a", "#999"];

function renderJob(job) {
  const s = job.series;
  // reward and eval on one version axis (eval is measured on some versions only)
  const versions = [...new Set([...s.reward.map((r) => r[0]), ...s.eval.map((r) => r[0])])].sort((a, b) => a - b);
  const rw = new Map(s.reward), ev = new Map(s.eval);
  chart("reward", $("#chart-reward"),
    [{ label: "mean reward", stroke: COLORS[0] }, { label: "held-out accuracy", stroke: COLORS[1], points: { show: true } }],
    [versions, versions.map((v) => rw.get(v) ?? null), versions.map((v) => ev.get(v) ?? null)]);
  chart("throughput", $("#chart-throughput"),
    [{ label: "rollouts/s", stroke: COLORS[2] }, { label: "versions/min", stroke: COLORS[4] }],
    [s.t, s.rollouts_per_s, s.versions_per_min], { time: true, zero: true });
  chart("staleness", $("#chart-staleness"),
    [{ label: "mean", stroke: COLORS[0] }, { label: "max", stroke: COLORS[3] }],
    [s.staleness.map((r) => r[0]), s.staleness.map((r) => r[1]), s.staleness.map((r) => r[2])], { zero: true });
  const reasons = Object.keys(s.rejections).sort();
  chart("rejections", $("#chart-rejections"),
    reasons.length ? reasons.map((r, i) => ({ label: r, stroke: COLORS[i % COLORS.length] }))
      : [{ label: "none", stroke: COLORS[7] }],
    [s.t, ...(reasons.length ? reasons.map((r) => s.rejections[r]) : [s.t.map(() => 0)])], { time: true, zero: true });
  renderTree(job.tree);
}

function renderTree(tree) {
  const box = $("#tree");
  if (!tree) { box.textContent = "no plan yet (one is made when the learner publishes a version)"; $("#tree-info").textContent = ""; return; }
  $("#tree-info").textContent = `${tree.kind}, ${tree.stripes} stripe(s), ${tree.edges.length} edges`;
  // Layers by hops from the source in the first stripe that reaches each node.
  const depth = new Map([[tree.source, 0]]);
  for (let changed = true; changed;) {
    changed = false;
    for (const e of tree.edges) if (depth.has(e.from) && !depth.has(e.to)) { depth.set(e.to, depth.get(e.from) + 1); changed = true; }
  }
  const layers = [];
  for (const [n, d] of depth) (layers[d] ||= []).push(n);
  const W = Math.max(600, box.clientWidth || 600), rowH = 70, H = rowH * layers.length + 20;
  const pos = new Map();
  layers.forEach((ns, d) => ns.forEach((n, i) => pos.set(n, [(i + 1) * W / (ns.length + 1), 25 + d * rowH])));
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  const el = (tag, attrs, text) => { const x = document.createElementNS(NS, tag); for (const k in attrs) x.setAttribute(k, attrs[k]); if (text != null) x.textContent = text; svg.append(x); return x; };
  for (const e of tree.edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    if (!a || !b) continue;
    el("line", { x1: a[0], y1: a[1], x2: b[0], y2: b[1], stroke: COLORS[e.stripe % COLORS.length],
      "stroke-width": e.measured_bps ? 2.5 : 1, "stroke-dasharray": e.measured_bps ? "" : "4 3", class: "edge" });
    const label = e.measured_bps ? rate(e.measured_bps) : (e.planned_bps ? "plan " + rate(e.planned_bps) : "");
    if (label) el("text", { x: (a[0] + b[0]) / 2 + 4, y: (a[1] + b[1]) / 2, class: "edge-label" }, label);
  }
  for (const [n, [x, y]] of pos) {
    el("circle", { cx: x, cy: y, r: n === tree.source ? 9 : 7, fill: n === tree.source ? "#1d2330" : "#2f6fde", class: "node" });
    el("text", { x: x + 10, y: y - 8 }, n === tree.source ? "learner" : short(n));
  }
  box.replaceChildren(svg);
}

function renderOperator(snap) {
  state.last = snap;
  fillTable("#jobs", snap.jobs.map((j) => [
    cell(short(j.job_id)), cell(j.name), cell(j.status), cell(j.current_version, "num"), cell(j.schedule.learner),
    cell(`${num(j.schedule.need_rollouts_per_s)} / ${num(j.schedule.have_rollouts_per_s)}`), cell((j.schedule.nodes || []).length, "num")]));
  const sel = $("#job-select");
  const ids = snap.jobs.map((j) => j.job_id);
  if (sel.options.length !== ids.length || [...sel.options].some((o, i) => o.value !== ids[i])) {
    sel.replaceChildren(...snap.jobs.map((j) => { const o = document.createElement("option"); o.value = j.job_id; o.textContent = `${j.name} (${short(j.job_id)})`; return o; }));
    if (!ids.includes(state.job)) state.job = ids.find((id, i) => snap.jobs[i].status === "running") || ids[ids.length - 1] || null;
    if (state.job) sel.value = state.job;
  }
  const job = snap.jobs.find((j) => j.job_id === state.job);
  if (job) renderJob(job);
  fillTable("#nodes", snap.nodes.map((n) => [
    cell(short(n.node_id)), cell(n.engine), cell(n.reachability), cell(num(n.tokens_per_s, 0), "num"), cell(short(n.job)),
    cell(n.version, "num"), cell(ago(n.last_seen)), cell(n.accepted, "num"), cell(n.rejected, "num"), cell(num(n.credits, 3), "num")]));
  fillTable("#moves", snap.moves.map((m) => [cell(ago(m.at)), cell(short(m.node_id)), cell(short(m.from) || "standby"),
    cell(short(m.to) || "standby"), cell(m.why)]));
}

// ---------------------------------------------------------------- wiring
let stopOperator = null;
function setConn(text) { $("#conn").textContent = text; }

function startOperator() {
  if (stopOperator) stopOperator();
  stopOperator = null;
  $("#operator").hidden = true;
  $("#lock").hidden = !state.token;
  if (!state.token) return;
  stopOperator = stream("/v1/events", { Authorization: "Bearer " + state.token },
    (ev, data) => { if (ev === "snapshot") { $("#operator").hidden = false; renderOperator(data); } },
    (st) => {
      setConn(st === "unauthorized" ? "wrong token: public view only" : st);
      if (st === "unauthorized") { sessionStorage.removeItem("echo-token"); state.token = ""; $("#lock").hidden = true; }
    });
}

$("#token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("#token").value.trim();
  $("#token").value = "";
  if (state.token) sessionStorage.setItem("echo-token", state.token);
  startOperator();
});
$("#lock").addEventListener("click", () => { sessionStorage.removeItem("echo-token"); state.token = ""; startOperator(); setConn("public view"); });
$("#job-select").addEventListener("change", (e) => { state.job = e.target.value; if (state.last) renderOperator(state.last); });
$("#node-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const id = $("#node-id").value.trim();
  if (id) { location.hash = "node=" + encodeURIComponent(id); showNode(id); }
});
const fromHash = new URLSearchParams(location.hash.slice(1)).get("node");
if (fromHash) $("#node-id").value = fromHash;

stream("/v1/public/events", {}, (ev, data) => { if (ev === "snapshot") renderPublic(data); },
  (st) => { if (!state.token) setConn(st === "live" ? "public view (live)" : st); });
startOperator();
