// The kilnproxy inspector page: plain JavaScript on the JSON API of docs/inspector.md.
"use strict";

const PAGE = 50;
// The most rows the list keeps as live rows arrive (more if "older requests" loaded more): each new row
// lays the whole table out again, a second per row once it holds 40,000.
const MAX_ROWS = 1000;
const MAX_SERIES = 10;  // a chart's series: the largest, the others summed (a client may name 10,000 models)
const state = { filters: {}, next: null, seen: new Set(), meta: null, charts: {}, usageTimer: null,
                maxRows: MAX_ROWS };

// -- talking to the gateway --------------------------------------------------------

const token = (() => {
  const given = new URLSearchParams(location.search).get("token");
  if (given) sessionStorage.setItem("kilnproxy-inspector-token", given);
  return given || sessionStorage.getItem("kilnproxy-inspector-token");
})();

async function api(path, params = {}, method = "GET", payload = undefined) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) if (v) url.searchParams.set(k, v);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  if (payload !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(url, { method, headers, body: payload === undefined ? undefined : JSON.stringify(payload) });
  const body = await resp.json();
  api.lastStatus = resp.status;
  if (!resp.ok) throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
  return body;
}

function live() {
  const url = new URL("/ui/api/events", location.origin);
  if (token) url.searchParams.set("token", token);
  const source = new EventSource(url);
  const badge = document.getElementById("live");
  let opened = false;
  source.onopen = () => {
    badge.className = "live on"; badge.textContent = "live";
    if (opened) loadRequests();  // back after a break: rows may have been committed meanwhile
    opened = true;
  };
  source.onerror = () => { badge.className = "live off"; badge.textContent = "reconnecting"; };
  source.onmessage = (msg) => {
    const event = JSON.parse(msg.data);
    if (event.type === "request") { addLiveRow(event.row); scheduleUsage(); scheduleOrgs(); }
    else if (event.type === "started") addLiveRow(event.row);
    else if (event.type === "reset") loadRequests();
  };
}

// -- small helpers -----------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
const $ = (id) => document.getElementById(id);
// A cell of text someone else chose (a model a client asked for, a key's name): cut to the column's width,
// whole in its tooltip, so that one long value cannot push the table's other columns off the page.
const textCell = (text) => el("td", { class: "text", text, title: text });
const ms = (v) => (v === null || v === undefined ? "–" : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${Math.round(v)} ms`);
const localTime = (iso) => new Date(iso).toLocaleTimeString([], { hour12: false });
function statusClass(s) { return s >= 500 ? "s-err" : s >= 400 ? (s === 429 ? "s-warn" : "s-err") : "s-ok"; }
function pretty(text) {
  if (text === null || text === undefined) return "(not captured)";
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

// -- the requests list -------------------------------------------------------------

function rowElement(row, fresh) {
  if (row.status === undefined) return inFlightElement(row);
  const tr = el("tr", { "data-id": row.id, class: fresh ? "new" : "" },
    el("td", { text: localTime(row.created_at), title: row.created_at }),
    textCell(row.org), textCell(row.model || "–"),
    el("td", { text: row.endpoint + (row.stream ? " (stream)" : "") }),
    el("td", { class: statusClass(row.status), text: row.status + (row.error_code ? ` ${row.error_code}` : "")
                + (row.disconnected ? " (left)" : "") }),
    el("td", { class: "num", text: `${row.prompt_tokens} / ${row.completion_tokens}` }),
    el("td", { class: "num", text: money(row.cost) }),
    el("td", { class: "num", text: ms(row.duration_ms) }),
    el("td", { class: "num", text: ms(row.ttft_ms) }),
    el("td", { text: row.captured ? "●" : "", title: row.captured ? "captured" : "" }));
  tr.addEventListener("click", () => { location.hash = `#/requests/${encodeURIComponent(row.id)}`; });
  return tr;
}

function inFlightElement(row) {  // a captured request that has not ended yet: its row replaces this
  const tr = el("tr", { "data-id": row.id, class: "new inflight" },
    el("td", { text: localTime(row.created_at), title: row.created_at }), textCell(row.org),
    textCell(row.model || "–"), el("td", { text: row.endpoint }), el("td", { text: "in flight" }),
    ...[1, 2, 3, 4].map(() => el("td", { class: "num", text: "…" })), el("td", { text: "●", title: "captured" }));
  tr.addEventListener("click", () => { location.hash = `#/requests/${encodeURIComponent(row.id)}`; });
  return tr;
}

function matches(row) {
  const f = state.filters;
  if (f.org && row.org !== f.org) return false;
  if (f.model && row.model !== f.model) return false;
  if (f.status && row.status === undefined) return false;  // in flight: its status is not known yet
  if (f.status === "ok") return row.status < 400;
  if (f.status === "error") return row.status >= 400;
  if (f.status) return String(row.status) === f.status;
  return true;
}

function addLiveRow(row) {
  if (!matches(row)) return;
  const old = state.seen.has(row.id) && $("requests").querySelector(`tr[data-id="${CSS.escape(row.id)}"]`);
  if (old) {  // in flight until now, or a replica_lost row that its replica's own row replaced
    if (row.status !== undefined) old.replaceWith(rowElement(row, old.classList.contains("inflight")));
    return;
  }
  state.seen.add(row.id);
  $("requests").tBodies[0].prepend(rowElement(row, true));
  $("empty").hidden = true;
  trimList();
}

function trimList() {  // drop the oldest rows past state.maxRows; "older requests" then goes on from the last kept
  const rows = $("requests").tBodies[0].rows;
  if (rows.length <= state.maxRows) return;
  while (rows.length > state.maxRows) {
    state.seen.delete(rows[rows.length - 1].dataset.id);
    rows[rows.length - 1].remove();
  }
  state.next = cursorThrough(rows[rows.length - 1].cells[0].title);
  $("more").hidden = false;
}

// A cursor (the API's form, queries.cursor_of) for the rows created at `createdAt` or before: the largest
// row id takes in all of that millisecond; loadRequests skips the rows it lists already.
function cursorThrough(createdAt) {
  return btoa(`${createdAt}~9223372036854775807`).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

async function loadRequests(append = false) {
  const body = $("requests").tBodies[0];
  const page = await api("/ui/api/requests", { ...state.filters, limit: PAGE, before: append ? state.next : "" });
  if (!append) { body.replaceChildren(); state.seen.clear(); }
  for (const row of page.data) {
    if (state.seen.has(row.id)) continue;
    state.seen.add(row.id);
    body.append(rowElement(row, false));
  }
  state.next = page.next;
  state.maxRows = append ? Math.max(MAX_ROWS, body.rows.length) : MAX_ROWS;  // keep what was asked for
  $("more").hidden = !page.next;
  $("empty").hidden = body.rows.length > 0;
}

function readFilters() {
  const form = new FormData($("filters"));
  state.filters = Object.fromEntries([...form.entries()].filter(([, v]) => v).map(([k, v]) => [k, v.trim()]));
}

// -- one request -------------------------------------------------------------------

function batchFact(batchId) {  // a Batch API line's row: its batch, on the Batches page
  const link = el("a", { href: `#/batches/${encodeURIComponent(batchId)}`, text: batchId });
  return el("div", {}, el("dt", { text: "batch" }), el("dd", {}, link));
}
function fact(name, value) { return el("div", {}, el("dt", { text: name }), el("dd", { text: value })); }

function eventList(list, events) {
  list.replaceChildren(...events.map((e) => el("li", { class: e.data === "[DONE]" ? "done" : e.kind },
    el("span", { class: "t", text: `+${e.ms.toFixed(1)} ms` }),
    el("span", { class: "d", text: e.kind === "omitted"  // a long stream: its first and last events are listed
      ? `… ${e.count.toLocaleString()} events not listed (the API lists a stream's first and last 1,000) …`
      : e.data }))));
  if (!events.length) list.append(el("li", {}, el("span", { class: "t" }), el("span", { class: "d", text: "(none)" })));
}

async function showDetail(id) {
  const detail = await api(`/ui/api/requests/${encodeURIComponent(id)}`);
  clearTimeout(state.detailTimer);
  if (detail.in_flight) {  // follow the streams as they grow, until the request's row is written
    state.detailTimer = setTimeout(() => {
      if (location.hash === `#/requests/${encodeURIComponent(id)}`) showDetail(id).catch(() => {});
    }, 500);
  }
  const row = detail.row, cap = detail.capture, timing = cap ? cap.timing : {};
  $("detail-title").textContent = id;
  const facts = [];
  if (row) {
    facts.push(fact("time", new Date(row.created_at).toLocaleString()), fact("org", row.org),
      fact("model", row.model || "–"), fact("endpoint", row.endpoint + (row.stream ? " (stream)" : "")),
      fact("upstream", row.upstream || "–"),
      ...(row.batch_id ? [batchFact(row.batch_id)] : []),
      fact("status", `${row.status}${row.error_code ? " " + row.error_code : ""}`),
      fact("tokens in / out", `${row.prompt_tokens} / ${row.completion_tokens}`),
      fact("cached tokens", String(row.cached_tokens)), fact("cost", money(row.cost)),
      fact("duration", ms(row.duration_ms)), fact("TTFT", ms(row.ttft_ms)),
      fact("finish", row.finish_reason || "–"), fact("client left", row.disconnected ? "yes" : "no"));
  } else facts.push(fact("state", "in flight"));
  if (cap) facts.push(fact("tokens / s", timing.tokens_per_second ? timing.tokens_per_second.toFixed(1) : "–"),
    fact("captured", `${(cap.bytes / 1024).toFixed(1)} KiB${cap.truncated ? " (truncated)" : ""}`));
  if (detail.trace) facts.push(fact("trace", detail.trace.trace_id));
  $("detail-facts").replaceChildren(...facts);
  const traceLink = $("trace-link");  // [tracing] trace_url: the request's trace in the tracing backend
  traceLink.hidden = !detail.trace;
  if (detail.trace) traceLink.href = detail.trace.url;

  const note = $("detail-note");
  note.textContent = !cap ? (state.meta && state.meta.capture
    ? "This request is no longer in the capture ring (or was refused before its body was read)."
    : "Bodies and streams are not captured: set [inspector] capture = true in the config.")
    : cap.truncated ? "The capture reached [inspector] capture_bytes and stops there." : "";
  const save = $("save-fixture"), href = new URL(`/ui/api/requests/${encodeURIComponent(id)}/fixture`, location.origin);
  if (token) href.searchParams.set("token", token);
  save.href = href;
  save.hidden = !(cap && row && !cap.truncated);
  $("detail-bodies").hidden = !cap;
  $("detail-streams").hidden = !cap;
  if (cap) {
    $("client-body").textContent = pretty(cap.client_body);
    $("upstream-body").textContent = pretty(cap.upstream_body);
    if (cap.upstream_body === null && !cap.truncated) $("upstream-body").textContent = "(nothing was sent upstream)";
    if (cap.upstream_answer === null && cap.client_answer === null) {  // streamed
      eventList($("upstream-events"), cap.upstream_events);
      eventList($("client-events"), cap.client_events);
    } else {  // one JSON answer each way (or an upstream 400/422 passed through)
      eventList($("upstream-events"), [{ ms: timing.ttft_ms || 0, kind: "data", data: pretty(cap.upstream_answer) }]);
      eventList($("client-events"), [{ ms: row ? row.duration_ms : 0, kind: "data", data: pretty(cap.client_answer) }]);
    }
  }
}

// -- usage charts ------------------------------------------------------------------

const PALETTE = ["#c2410c", "#0369a1", "#15803d", "#7c3aed", "#a16207", "#be185d", "#0f766e", "#4b5563"];

function scheduleUsage() {  // new rows refresh the charts, at most every 3 s and one query at a time
  if ($("view-usage").hidden || state.usageTimer) return;
  state.usageTimer = setTimeout(async () => {
    try { await loadUsage(); } finally { state.usageTimer = null; }
  }, 3000);
}

async function loadUsage() {
  const form = new FormData($("usage-controls"));
  const by = form.get("by");
  const usage = await api("/ui/api/usage", { bucket: form.get("bucket") });
  const group = seriesGroups(usage.series, by);
  const keys = [...group.shown].sort();
  if (group.others) keys.push(OTHERS);
  const index = new Map(usage.buckets.map((b, i) => [b, i]));
  const labels = usage.buckets.map((b) => (b.length > 10 ? localTime(b.length === 13 ? b + ":00Z" : b + "Z").slice(0, 5)
                                                           : b));
  for (const [name, field] of [["requests", "requests"], ["tokens", "total_tokens"], ["cost", "cost"]]) {
    const datasets = keys.map((key, i) => {
      const data = new Array(labels.length).fill(0);
      for (const s of usage.series) if (group(s) === key && index.has(s.t)) data[index.get(s.t)] += s[field];
      const label = key === OTHERS ? `${group.others} others` : key.length > 40 ? `${key.slice(0, 39)}…` : key;
      const color = key === OTHERS ? "#a8a29e" : PALETTE[i % PALETTE.length];
      return { label, data, backgroundColor: color, stack: "all" };
    });
    drawChart(name, labels, datasets);
  }
}

const OTHERS = Symbol("others");

function seriesGroups(series, by) {  // series -> its key, or OTHERS past the MAX_SERIES - 1 with most requests
  const requests = new Map();
  for (const s of series) requests.set(s[by] || "–", (requests.get(s[by] || "–") || 0) + s.requests);
  const ranked = [...requests.keys()].sort((a, b) => requests.get(b) - requests.get(a) || (a < b ? -1 : 1));
  const shown = new Set(ranked.length > MAX_SERIES ? ranked.slice(0, MAX_SERIES - 1) : ranked);
  const group = (s) => (shown.has(s[by] || "–") ? s[by] || "–" : OTHERS);
  group.shown = shown;
  group.others = ranked.length - shown.size;
  return group;
}

function drawChart(name, labels, datasets) {
  const chart = state.charts[name];
  if (chart) { chart.data.labels = labels; chart.data.datasets = datasets; chart.update("none"); return; }
  state.charts[name] = new Chart($(`chart-${name}`), {
    type: "bar", data: { labels, datasets },
    options: { animation: false, maintainAspectRatio: false, responsive: true,
      scales: { x: { stacked: true, ticks: { maxTicksLimit: 16 } },
                y: { stacked: true, beginAtZero: true, ticks: name === "cost" ? { callback: (v) => money(v) } : { precision: 0 } } },
      plugins: { legend: { position: "right" }, ...(name === "cost" ? { tooltip: COST_TOOLTIP } : {}) } },
  });
}

// Chart.js writes a tooltip's figure with three decimals at most ($0.0000002 would be 0): money.js's instead.
const COST_TOOLTIP = { callbacks: { label: (item) => `${item.dataset.label}: ${money(item.parsed.y)}` } };

// -- navigation --------------------------------------------------------------------

async function route() {
  const hash = location.hash || "#/requests";
  const detail = hash.match(/^#\/requests\/(.+)$/);
  const view = detail ? "detail" : ["usage", "orgs", "upstreams", "batches"].find((v) => hash.startsWith(`#/${v}`)) || "requests";
  for (const v of ["requests", "detail", "usage", "orgs", "upstreams", "batches"]) $(`view-${v}`).hidden = v !== view;
  $("tab-requests").classList.toggle("active", view === "requests" || view === "detail");
  for (const v of ["usage", "orgs", "upstreams", "batches"]) $(`tab-${v}`).classList.toggle("active", view === v);
  try {
    if (detail) await showDetail(decodeURIComponent(detail[1]));
    else if (view === "usage") await loadUsage();
    else if (view === "orgs") await showOrgs(hash);
    else if (view === "upstreams") await showUpstreams();
    else if (view === "batches") await showBatches(hash);
  } catch (err) {
    $("detail-title").textContent = String(err.message || err);
  }
}

async function main() {
  state.meta = await api("/ui/api/meta");
  $("orgs").replaceChildren(...state.meta.orgs.map((o) => el("option", { value: o })));
  $("models").replaceChildren(...state.meta.models.map((m) => el("option", { value: m })));
  $("capture-state").textContent = state.meta.capture ? `capture on (last ${state.meta.capture_requests})`
                                                      : "capture off";
  $("filters").addEventListener("change", () => { readFilters(); loadRequests(); });
  $("filters").addEventListener("reset", () => setTimeout(() => { readFilters(); loadRequests(); }));
  $("more").addEventListener("click", () => loadRequests(true));
  $("usage-controls").addEventListener("change", loadUsage);
  window.addEventListener("hashchange", route);
  await loadRequests();
  live();
  await route();
}

main().catch((err) => { document.querySelector("main").prepend(el("p", { class: "s-err", text: String(err.message || err) })); });
