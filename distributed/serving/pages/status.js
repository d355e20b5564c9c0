// The status page: polls GET /v1/status once a second (polling, not server-sent events:
// EventSource cannot send the bearer header) and draws it. When the ring is down the
// last rank map stays, dimmed, beside the state, the reason and the restart count.
"use strict";

const POLL_MS = 1000;
const CHART_STEPS = 30; // the chart's width in the document's history steps (10 s each: five minutes)
const AXIS_Y = 125; // the chart's zero line
let lastState = null;

function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

function fixed(value, digits, unit) {
  return value === null || value === undefined ? "–" : value.toFixed(digits) + (unit || "");
}

function percent(value) { return value === null || value === undefined ? "–" : (100 * value).toFixed(0) + "%"; }

function duration(s) {
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  return (h ? h + " h " : "") + (h || m ? m + " min " : "") + sec + " s";
}

function drawRing(ranks) {
  const ring = document.getElementById("ring");
  ring.replaceChildren();
  const total = Math.max(1, ...ranks.map((r) => r.layers[1]));
  for (const r of ranks) {
    const box = el("div", "rank" + (r.alive ? "" : " dead"));
    const [start, end] = r.layers;
    box.style.flex = String(end - start) + " 1 0"; // to scale: its share of the layers
    Object.assign(box.dataset, { rank: r.rank, host: r.host, start: start, end: end });
    box.append(el("div", "host", r.host), el("div", "layers", "rank " + r.rank + " · layers [" + start + ", " + end + ")"));
    const tags = el("div", "tags");
    if (r.embed) tags.append(el("span", "", "embed"));
    if (r.head) tags.append(el("span", "", "head"));
    if (!r.alive) tags.append(el("span", "", "down"));
    box.append(tags);
    if (r.tensor) box.append(drawShare(r.tensor));
    // Used: MLX's active bytes now (the router knows only the peak at load); of them weights, caches, the rest.
    const used = typeof r.active_memory_bytes === "number" ? r.active_memory_bytes : r.peak_memory_bytes;
    const memory = el("div", "memory"), whole = Math.max(r.memory_bytes || 0, used || 0, 1);
    const weights = r.parameter_bytes || 0, kv = r.kv_cache_bytes || 0, prefix = r.prefix_cache_bytes || 0;
    const other = Math.max(0, (used || 0) - weights - kv - prefix);
    for (const [cls, n] of [["weights", weights], ["kv", kv], ["prefix", prefix], ["other", other]]) {
      const part = el("span", cls);
      part.style.width = (100 * n / whole).toFixed(2) + "%";
      memory.append(part);
    }
    box.append(memory);
    box.append(el("div", "muted", bytes(used) + " of " + bytes(r.memory_bytes) + " · peak " + bytes(r.peak_memory_bytes)));
    box.append(el("div", "muted", "KV " + bytes(r.kv_cache_bytes) + " · prefix " + bytes(r.prefix_cache_bytes)));
    box.append(el("div", "forward", "forward " + percent(r.forward_share)));
    ring.append(box);
  }
  document.getElementById("ring-note").textContent = ranks.length ? ranks.length + " ranks, " + total + " layers" : "no ranks yet";
}

// A tensor-parallel rank's share of each of its layers (--tensor-parallel-size): its slice of the
// query heads drawn to scale, its KV heads and its slice of every expert's width named.
function drawShare(t) {
  const share = el("div", "share");
  const [a, b] = t.heads, heads = (b - a) * t.size;
  const bar = el("div", "share-bar"), part = el("span");
  part.style.left = (100 * a / heads).toFixed(2) + "%";
  part.style.width = (100 * (b - a) / heads).toFixed(2) + "%";
  bar.append(part);
  const experts = t.experts ? " · " + t.experts + " experts, width [" + t.expert_width.join(", ") + ")" : "";
  share.append(bar, el("div", "muted", "tensor " + t.rank + "/" + t.size + " · heads [" + t.heads.join(", ") +
    ") · KV [" + t.kv_heads.join(", ") + ")" + experts));
  return share;
}

function drawCounters(doc) {
  const req = doc.requests, last = doc.last_minute, spec = doc.speculative, prefix = doc.prefix_cache;
  const rows = [
    ["running", req.running + (req.max_batch ? " / " + req.max_batch : "")],
    ["waiting", req.waiting],
    ["served", req.served],
    ["generated tokens", doc.tokens.generated],
    ["prompt tokens (cached)", doc.tokens.prompt + " (" + doc.tokens.cached + ")"],
    ["tok/s, last minute", fixed(last.tokens_per_s, 1)],
    ["TTFT p50", fixed(last.ttft_p50_s === null ? null : 1000 * last.ttft_p50_s, 0, " ms")],
    ["TTFT p99", fixed(last.ttft_p99_s === null ? null : 1000 * last.ttft_p99_s, 0, " ms")],
    ["prefix-cache hit rate", prefix ? percent(prefix.hit_rate) + " of " + prefix.lookups : "off"],
    ["prefix cache on disk", prefix && prefix.disk ? prefix.disk.loads + " loads, " + prefix.disk.entries + " files, "
      + bytes(prefix.disk.bytes) : "off"],
    ["speculative acceptance", spec ? percent(spec.acceptance) + " of " + spec.drafted : "off"],
    ["KV cache", doc.kv_bits ? doc.kv_bits + "-bit full attention" : "whole"],
    ["ring failures", doc.ring.failures],
    ["restarts", doc.ring.restarts],
  ];
  const list = document.getElementById("counters");
  list.replaceChildren();
  for (const [name, value] of rows) {
    const item = el("div");
    item.dataset.counter = name;
    item.append(el("dt", "", name), el("dd", "", String(value)));
    list.append(item);
  }
}

// One series of the chart: a line through a point per step, each point a dot too (a first step
// alone shows); null (nothing that step, e.g. no first token) leaves a gap.
function series(values, scale, cls) {
  const svg = "http://www.w3.org/2000/svg", group = document.createElementNS(svg, "g");
  const step = 580 / (CHART_STEPS - 1), offset = CHART_STEPS - values.length; // x from 10 to 590: dots show whole
  const points = values.map((v, i) => v === null ? null : [10 + (offset + i) * step, AXIS_Y - 110 * v / scale]);
  const line = document.createElementNS(svg, "polyline");
  line.setAttribute("points", points.filter((p) => p !== null).map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" "));
  group.setAttribute("class", cls);
  group.append(line);
  for (const p of points.filter((p) => p !== null)) {
    const dot = document.createElementNS(svg, "circle");
    Object.entries({ cx: p[0].toFixed(1), cy: p[1].toFixed(1), r: 3 }).forEach(([k, v]) => dot.setAttribute(k, v));
    group.append(dot);
  }
  return group;
}

function label(x, y, text, anchor) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", "text");
  node.setAttribute("x", x);
  node.setAttribute("y", y);
  node.setAttribute("text-anchor", anchor);
  node.textContent = text;
  return node;
}

function drawChart(history) {
  const svg = document.getElementById("chart");
  const points = history.points.slice(-CHART_STEPS);
  const tps = points.map((p) => p.tokens_per_s), ttft = points.map((p) => p.ttft_p50_s);
  const tpsMax = Math.max(1, ...tps), ttftMax = Math.max(0.001, ...ttft.map((v) => v || 0));
  const axis = document.createElementNS("http://www.w3.org/2000/svg", "line");
  Object.entries({ x1: 0, y1: AXIS_Y, x2: 600, y2: AXIS_Y, class: "axis" }).forEach(([k, v]) => axis.setAttribute(k, v));
  svg.replaceChildren(axis, series(tps, tpsMax, "tps"), series(ttft, ttftMax, "ttft"),
    label(2, 10, tpsMax.toFixed(1) + " tok/s", "start"), label(598, 10, (1000 * ttftMax).toFixed(0) + " ms", "end"),
    label(2, 137, (CHART_STEPS * history.step_s / 60).toFixed(0) + " min ago", "start"), label(598, 137, "now", "end"));
}

function noteEvent(doc) {
  if (doc.status === lastState) return;
  lastState = doc.status;
  const item = el("li", "", new Date().toLocaleTimeString() + " " + doc.status + (doc.reason ? ": " + doc.reason : ""));
  item.dataset.state = doc.status;
  document.getElementById("events").prepend(item);
}

function render(doc) {
  const serving = doc.status === "serving";
  const state = document.getElementById("state");
  state.textContent = serving ? "SERVING" : "NOT_SERVING · " + doc.status;
  state.className = "badge" + (serving ? " serving" : "");
  state.dataset.state = doc.status;
  document.getElementById("model").textContent = doc.model || "";
  document.getElementById("uptime").textContent = "up " + duration(doc.uptime_s) +
    (doc.ring.restarts ? " · " + doc.ring.restarts + " restarts" : "");
  const reason = document.getElementById("reason");
  reason.hidden = !doc.reason;
  reason.textContent = doc.reason || "";
  drawRing(doc.ranks);
  drawCounters(doc);
  drawChart(doc.history);
  noteEvent(doc);
}

async function poll() {
  for (;;) {
    try {
      const response = await authorizedFetch("/v1/status");
      render(await response.json());
    } catch (error) { // the server itself is gone (not the ring: the router answers while it restarts)
      const state = document.getElementById("state");
      state.textContent = "unreachable";
      state.className = "badge";
      state.dataset.state = "unreachable";
    }
    await sleep(POLL_MS);
  }
}

poll();
