// The org admins' portal (docs/portal.md): one org's balance, spend and keys through the org API (/v1/org),
// signed in with an admin key. The key lives in this script's memory only (no cookie, no storage, never in
// the address): reloading the page signs out. Uses money.js's money and Chart.js.
"use strict";

const DAY_MS = 86400000;
const session = { key: null, keys: [], chart: null };

// -- talking to the org API ------------------------------------------------------

class Refused extends Error {  // an answer of 400 and above: the API's error object
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
  }
}

async function orgApi(path, { method = "GET", params = {}, body } = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) url.searchParams.set(k, v);
  const headers = { Authorization: `Bearer ${session.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(url, { method, headers, credentials: "omit", cache: "no-store",
                                  body: body === undefined ? undefined : JSON.stringify(body) });
  let answer = null;
  try { answer = await resp.json(); } catch { answer = null; }
  if (!resp.ok) throw new Refused(resp.status, (answer && answer.error) || {});
  return answer;
}

// -- small helpers ----------------------------------------------------------------

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
const textCell = (text) => el("td", { class: "text", text, title: text });  // a name someone chose: cut, whole in its tooltip
const numCell = (text) => el("td", { class: "num", text });
const count = (n) => n.toLocaleString("en-US");
const isoDay = (ms) => new Date(ms).toISOString().slice(0, 10);
const when = (iso) => (iso ? new Date(iso).toLocaleString([], { hour12: false }) : "–");

function refusalText(err) {
  return err instanceof Refused ? `${err.message} (${err.status}${err.code ? " " + err.code : ""})` : String(err.message || err);
}

// -- signing in and out -------------------------------------------------------------

async function signIn(event) {
  event.preventDefault();
  const input = $("key-input");
  session.key = input.value.trim();
  input.value = "";  // the key leaves the form: only session.key holds it
  $("sign-in-error").textContent = "";
  let org;
  try { org = await orgApi("/v1/org"); } catch (err) {
    signOut();
    $("sign-in-error").textContent = signInRefusal(err);
    return;
  }
  $("sign-in").hidden = true;
  $("dashboard").hidden = false;
  $("who").hidden = false;
  showOrg(org);
  await attempt(loadAll);
}

function signInRefusal(err) {
  if (err.status === 403) return `This key is not an admin key: it may call models, not manage its org (403 ${err.code}).`;
  if (err.status === 401) return `The gateway does not know this key, or it was revoked or has expired (401 ${err.code}).`;
  return refusalText(err);
}

function signOut() {
  session.key = null;
  session.keys = [];
  forgetSecret();
  if (session.chart) { session.chart.destroy(); session.chart = null; }
  for (const id of ["by-model", "by-key", "keys-table"]) $(id).tBodies[0].replaceChildren();
  for (const id of ["org-id", "granted", "spent", "held", "remaining", "org-state", "spend-total", "error"]) {
    $(id).textContent = "";
  }
  $("dashboard").hidden = true;
  $("who").hidden = true;
  $("sign-in").hidden = false;
}

// Run a read or a change; a refusal shows on the page, and a key the gateway stopped accepting signs out.
async function attempt(action) {
  $("error").textContent = "";
  try { await action(); return true; } catch (err) {
    if (err instanceof Refused && (err.status === 401 || err.status === 403)) {
      signOut();
      $("sign-in-error").textContent = `Signed out: ${signInRefusal(err)}`;
    } else $("error").textContent = refusalText(err);
    return false;
  }
}

// -- the org, its spend, its keys ----------------------------------------------------

async function loadAll() {
  const [org] = await Promise.all([orgApi("/v1/org"), loadKeys()]);
  showOrg(org);
  await loadSpend();  // after the keys: the spend by key is named by them
}

function showOrg(org) {
  $("org-id").textContent = org.id;
  for (const field of ["granted", "spent", "held", "remaining"]) $(field).textContent = money(org[field]);
  $("remaining").className = org.remaining <= 0 ? "s-err" : "";
  $("org-state").textContent = org.disabled ? "disabled" : "active";
  $("org-state").className = org.disabled ? "s-err" : "s-ok";
}

// The spend of the last N days (UTC), from the first of them at 00:00 to now: by day (the chart, a bar for
// every day, 0 where the API has no row), by model and by key, and in all.
async function loadSpend() {
  const days = Number($("range").elements.days.value);
  const first = Date.parse(`${isoDay(Date.now())}T00:00:00Z`) - (days - 1) * DAY_MS;
  const from = isoDay(first);
  const [byDay, byModel, byKey, total] = await Promise.all(["day", "model", "key", ""].map(
    (group) => orgApi("/v1/org/usage", { params: group ? { from, group_by: group } : { from } })));
  const costs = new Map(byDay.data.map((r) => [r.day, r.cost]));
  const labels = Array.from({ length: days }, (_, i) => isoDay(first + i * DAY_MS));
  drawSpend(labels, labels.map((d) => costs.get(d) || 0));
  const [sum] = total.data;
  $("spend-total").textContent = sum ? `${money(sum.cost)} in ${count(sum.requests)} requests since ${from}` : "";
  const tokens = (r) => `${count(r.prompt_tokens)} / ${count(r.completion_tokens)}`;
  $("by-model").tBodies[0].replaceChildren(...byModel.data.map((r) => el("tr", { "data-model": r.model || "" },
    textCell(r.model || "–"), numCell(count(r.requests)), numCell(tokens(r)), numCell(money(r.cost)))));
  const names = new Map(session.keys.map((k) => [k.id, k.name]));
  $("by-key").tBodies[0].replaceChildren(...byKey.data.map((r) => el("tr", { "data-key": r.key_id || "" },
    textCell(names.get(r.key_id) || "–"), el("td", { text: r.key_id || "–" }), numCell(count(r.requests)),
    numCell(tokens(r)), numCell(money(r.cost)))));
}

function drawSpend(labels, costs) {
  const data = { labels, datasets: [{ label: "cost (USD)", data: costs, backgroundColor: "#c2410c" }] };
  if (session.chart) { session.chart.data = data; session.chart.update("none"); return; }
  session.chart = new Chart($("chart-spend"), {
    type: "bar", data,
    options: { animation: false, maintainAspectRatio: false, responsive: true,
      scales: { x: { ticks: { maxTicksLimit: 16 } }, y: { beginAtZero: true, ticks: { callback: (v) => money(v) } } },
      plugins: { legend: { display: false }, tooltip: { callbacks: { label: (item) => money(item.parsed.y) } } } },
  });
}

function keyState(k) {
  if (k.revoked) return ["revoked", "s-err"];
  if (k.disabled) return ["disabled", "s-err"];
  if (k.expires_at && new Date(k.expires_at) <= new Date()) return ["expired", "s-err"];
  return ["active", "s-ok"];
}

function usageCell(k) {
  const td = el("td", { class: "num usage", text: `${money(k.usage)} / ${k.limit === null ? "no limit" : money(k.limit)}` });
  if (k.limit !== null) {
    const share = k.limit > 0 ? Math.min(1, k.usage / k.limit) : 1;
    const fill = el("span");
    fill.style.width = `${(share * 100).toFixed(1)}%`;  // CSSOM: the page's CSP refuses style attributes
    td.append(el("div", { class: `bar ${share >= 1 ? "full" : ""}` }, fill));
    td.title = `${money(k.limit_remaining)} left this period`;
  }
  return td;
}

function keyActions(k) {
  const limitCell = el("td"), actions = el("td", { class: "actions" });
  if (k.source === "config") {
    actions.append(el("span", { class: "hint", text: "config", title: "the operator's config holds this key" }));
  } else if (!k.revoked) {
    const limit = el("input", { class: "limit", type: "number", min: "0", step: "any", placeholder: "none",
                                "aria-label": `limit of ${k.name}` });
    if (k.limit !== null) limit.value = String(k.limit);
    const set = el("button", { type: "button", class: "set-limit", text: "set limit" });
    set.addEventListener("click", () => setLimit(k, limit.value));
    limitCell.append(limit);
    const revoke = el("button", { type: "button", class: "revoke", text: "revoke" });
    revoke.addEventListener("click", () => revokeKey(k));
    actions.append(set, revoke);
  }
  return [limitCell, actions];
}

async function loadKeys() {
  session.keys = (await orgApi("/v1/org/keys")).data;
  $("keys-table").tBodies[0].replaceChildren(...session.keys.map((k) => {
    const [state, cls] = keyState(k);
    return el("tr", { "data-key": k.id },
      textCell(k.name), el("td", { text: k.id }), el("td", { text: k.prefix ? `${k.prefix}…` : "–" }),
      el("td", { class: "role", text: k.role }), usageCell(k), el("td", { text: k.limit_reset || "never" }),
      el("td", { text: when(k.expires_at) }), el("td", { class: `state ${cls}`, text: state }), ...keyActions(k));
  }));
}

async function createKey(event) {
  event.preventDefault();
  const form = new FormData($("key-form"));
  const body = { name: form.get("name").trim(), role: form.get("role") };
  if (form.get("limit")) body.limit = Number(form.get("limit"));
  if (form.get("limit_reset")) body.limit_reset = form.get("limit_reset");
  if (form.get("expires_at").trim()) body.expires_at = form.get("expires_at").trim();
  if (form.get("models").trim()) body.models = form.get("models").split(",").map((m) => m.trim()).filter(Boolean);
  await attempt(async () => {
    const made = await orgApi("/v1/org/keys", { method: "POST", body });
    $("secret-key-id").textContent = made.data.id;
    $("secret-value").textContent = made.key;  // only here, only now: the gateway keeps its hash
    $("secret-box").hidden = false;
    $("key-form").reset();
    await loadKeys();
  });
}

async function setLimit(k, raw) {
  const limit = raw.trim() === "" ? null : Number(raw);
  await attempt(async () => {
    await orgApi(`/v1/org/keys/${encodeURIComponent(k.id)}`, { method: "PATCH", body: { limit } });
    await loadKeys();
  });
}

async function revokeKey(k) {
  if (!window.confirm(`Revoke ${k.name} (${k.id})? Requests with it get 401 from now on; this cannot be undone.`)) return;
  await attempt(async () => {
    await orgApi(`/v1/org/keys/${encodeURIComponent(k.id)}`, { method: "DELETE" });
    await loadKeys();
  });
}

function forgetSecret() {
  $("secret-value").textContent = "";
  $("secret-key-id").textContent = "";
  $("secret-box").hidden = true;
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("refresh").addEventListener("click", () => attempt(loadAll));
  $("range").addEventListener("change", () => attempt(loadSpend));
  $("key-form").addEventListener("submit", createKey);
  $("secret-done").addEventListener("click", forgetSecret);
  $("secret-copy").addEventListener("click", async () => {
    const text = $("secret-value").textContent;
    try { await navigator.clipboard.writeText(text); $("secret-copy").textContent = "copied"; }
    catch { window.getSelection().selectAllChildren($("secret-value")); }  // no clipboard: select it for Ctrl+C
    setTimeout(() => { $("secret-copy").textContent = "copy"; }, 1500);
  });
});
