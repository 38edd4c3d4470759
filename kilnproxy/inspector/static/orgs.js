// The "Orgs & keys" view: balances, keys, grants; create and revoke keys, grant credits.
// Uses app.js's helpers (api, el, $) and money.js's money; the JSON endpoints are in docs/inspector.md.
"use strict";

const orgsState = { org: null, timer: null };

const day = (iso) => (iso ? new Date(iso).toLocaleString([], { hour12: false }) : "–");

async function showOrgs(hash) {
  const match = hash.match(/^#\/orgs\/(.+)$/);
  const org = match ? decodeURIComponent(match[1]) : null;
  if (org !== orgsState.org) forgetSecret();
  orgsState.org = org;
  await loadOrgs();
  $("org-panel").hidden = !orgsState.org;
  if (orgsState.org) await loadOrg();
}

function scheduleOrgs() {  // rows arriving move balances: refresh at most every 3 s while the view is open
  if ($("view-orgs").hidden || orgsState.timer) return;
  orgsState.timer = setTimeout(async () => {
    try { await loadOrgs(); if (orgsState.org) await loadKeys(); } finally { orgsState.timer = null; }
  }, 3000);
}

async function loadOrgs() {
  const orgs = (await api("/ui/api/orgs")).data;
  $("orgs-table").tBodies[0].replaceChildren(...orgs.map((o) => {
    const tr = el("tr", { "data-org": o.id, class: o.id === orgsState.org ? "selected" : "" },
      el("td", { text: o.id }), el("td", { text: o.source }),
      el("td", { class: "num granted", text: money(o.granted) }), el("td", { class: "num spent", text: money(o.spent) }),
      el("td", { class: "num held", text: money(o.held) }),
      el("td", { class: `num remaining ${o.remaining <= 0 ? "s-err" : ""}`, text: money(o.remaining) }),
      el("td", { class: "num", text: o.max_in_flight === null ? "default" : String(o.max_in_flight) }),
      el("td", { class: "priority", text: o.priority }), el("td", { class: "num weight", text: String(o.weight) }),
      el("td", { text: o.disabled ? "disabled" : "active", class: o.disabled ? "s-err" : "s-ok" }));
    tr.addEventListener("click", () => { location.hash = `#/orgs/${encodeURIComponent(o.id)}`; });
    return tr;
  }));
}

async function loadOrg() {
  $("org-title").textContent = orgsState.org;
  $("org-error").textContent = "";
  await Promise.all([loadKeys(), loadGrants()]);
}

function keyState(k) {
  if (k.revoked) return ["revoked", "s-err"];
  if (k.disabled) return ["disabled", "s-err"];
  if (k.expires_at && new Date(k.expires_at) <= new Date()) return ["expired", "s-err"];
  return ["active", "s-ok"];
}

function usageCell(k) {
  const text = k.limit === null ? `${money(k.usage)} / no limit` : `${money(k.usage)} / ${money(k.limit)}`;
  const td = el("td", { class: "num usage", text });
  if (k.limit !== null) {
    const share = k.limit > 0 ? Math.min(1, k.usage / k.limit) : 1;
    const fill = el("span");
    fill.style.width = `${(share * 100).toFixed(1)}%`;  // CSSOM: the page's CSP refuses style attributes
    td.append(el("div", { class: `bar ${share >= 1 ? "full" : ""}` }, fill));
    td.title = `${money(k.limit_remaining)} left this period`;
  }
  return td;
}

function shareCell(k) {  // the key's own priority and weight, or its org's (null)
  const priority = k.priority === null ? "org's" : k.priority;
  const weight = k.weight === null ? "org's" : String(k.weight);
  return el("td", { class: "share", text: `${priority} / ${weight}` });
}

async function loadKeys() {
  const keys = (await api("/ui/api/keys", { org: orgsState.org })).data;
  $("keys-table").tBodies[0].replaceChildren(...keys.map((k) => {
    const [state, cls] = keyState(k);
    const action = el("td");
    if (k.source === "config") action.append(el("span", { class: "hint", text: "config", title: "change it in the config" }));
    else if (!k.revoked) {
      const button = el("button", { type: "button", class: "revoke", text: "revoke" });
      button.addEventListener("click", () => revokeKey(k));
      action.append(button);
    }
    return el("tr", { "data-key": k.id },
      textCell(k.name), el("td", { text: k.id }), el("td", { text: k.prefix ? `${k.prefix}…` : "–" }),
      el("td", { class: "role", text: k.role }), usageCell(k), el("td", { text: k.limit_reset || "never" }),
      el("td", { text: day(k.expires_at) }), el("td", { class: "last-used", text: day(k.last_used) }), shareCell(k),
      el("td", { class: `state ${cls}`, text: state }), action);
  }));
}

async function loadGrants() {
  const grants = (await api(`/ui/api/orgs/${encodeURIComponent(orgsState.org)}/grants`)).data;
  $("grants-table").tBodies[0].replaceChildren(...grants.slice().reverse().map((g) => el("tr", { "data-grant": g.id },
    el("td", { text: day(g.created_at) }), el("td", { class: "num", text: money(g.amount) }),
    textCell(g.reference), el("td", { text: g.id }))));
}

async function change(action) {  // run a change; show its refusal (the API's message names the field)
  $("org-error").textContent = "";
  try { await action(); return true; } catch (err) { $("org-error").textContent = String(err.message || err); return false; }
}

async function createKey(event) {
  event.preventDefault();
  const form = new FormData($("key-form"));
  const body = { org: orgsState.org, name: form.get("name").trim() };
  if (form.get("limit")) body.limit = Number(form.get("limit"));
  if (form.get("limit_reset")) body.limit_reset = form.get("limit_reset");
  if (form.get("expires_at").trim()) body.expires_at = form.get("expires_at").trim();
  if (form.get("priority")) body.priority = form.get("priority");
  if (form.get("models").trim()) body.models = form.get("models").split(",").map((m) => m.trim()).filter(Boolean);
  if (form.get("role") === "admin") body.role = "admin";
  await change(async () => {
    const made = await api("/ui/api/keys", {}, "POST", body);
    $("secret-key-id").textContent = made.data.id;
    $("secret-value").textContent = made.key;  // only here, only now: the gateway keeps its hash
    $("secret-box").hidden = false;
    $("key-form").reset();
    await loadKeys();
  });
}

function forgetSecret() {
  $("secret-value").textContent = "";
  $("secret-key-id").textContent = "";
  $("secret-box").hidden = true;
}

async function revokeKey(k) {
  if (!window.confirm(`Revoke ${k.name} (${k.id})? Requests with it get 401 from now on; this cannot be undone.`)) return;
  await change(async () => { await api(`/ui/api/keys/${encodeURIComponent(k.id)}`, {}, "DELETE"); await loadKeys(); });
}

async function grantCredits(event) {
  event.preventDefault();
  const form = new FormData($("grant-form"));
  const raw = form.get("amount");
  const body = { amount: raw === "" ? null : Number(raw), reference: form.get("reference").trim() };
  await change(async () => {
    const resp = await api(`/ui/api/orgs/${encodeURIComponent(orgsState.org)}/grants`, {}, "POST", body);
    $("grant-note").textContent = api.lastStatus === 200  // 201: a new grant; 200: the reference's first grant
      ? `reference ${resp.reference} was used already: its grant of ${money(resp.amount)} stands, nothing added`
      : `granted ${money(resp.amount)}`;
    $("grant-form").reset();
    await Promise.all([loadOrgs(), loadGrants()]);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", createKey);
  $("grant-form").addEventListener("submit", grantCredits);
  $("secret-done").addEventListener("click", forgetSecret);
  $("secret-copy").addEventListener("click", async () => {
    const text = $("secret-value").textContent;
    try { await navigator.clipboard.writeText(text); $("secret-copy").textContent = "copied"; }
    catch { window.getSelection().selectAllChildren($("secret-value")); }  // no clipboard: select it for Ctrl+C
    setTimeout(() => { $("secret-copy").textContent = "copy"; }, 1500);
  });
});
