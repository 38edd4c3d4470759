// The "Upstreams" view: each model's upstreams, their prompt-cache hit rate and load (GET /ui/api/upstreams).
// Uses app.js's helpers (api, el, $, textCell); refreshed every 2 s while the view is open.
"use strict";

const UPSTREAMS_REFRESH_MS = 2000;
const upstreamsState = { timer: null };

const count = (v) => (v === null ? "–" : v.toLocaleString("en-US"));

async function showUpstreams() {
  clearTimeout(upstreamsState.timer);
  try {
    await loadUpstreams();
  } finally {  // again while the view stays open (a refusal or a gateway that went away included)
    upstreamsState.timer = setTimeout(() => { if (!$("view-upstreams").hidden) showUpstreams().catch(() => {}); },
                                      UPSTREAMS_REFRESH_MS);
  }
}

function hitRateCell(rate) {
  const td = el("td", { class: "num hit-rate", text: rate === null ? "–" : `${(rate * 100).toFixed(1)}%` });
  if (rate !== null) {
    const fill = el("span");
    fill.style.width = `${(rate * 100).toFixed(1)}%`;  // CSSOM: the page's CSP refuses style attributes
    td.append(el("div", { class: "bar" }, fill));
  }
  return td;
}

function upstreamState(u) {
  if (u.up === null) return ["not configured", "hint"];
  return u.up ? ["up", "s-ok"] : ["down", "s-err"];
}

async function loadUpstreams() {
  const upstreams = (await api("/ui/api/upstreams")).data;
  $("upstreams-table").tBodies[0].replaceChildren(...upstreams.map((u) => {
    const [state, cls] = upstreamState(u);
    return el("tr", { "data-model": u.model, "data-upstream": u.upstream },
      textCell(u.model), el("td", { text: u.routing || "–" }), textCell(u.upstream),
      el("td", { class: `state ${cls}`, text: state }), el("td", { class: "num load", text: count(u.load) }),
      el("td", { class: "num prompt", text: count(u.prompt_tokens) }),
      el("td", { class: "num cached", text: count(u.cached_tokens) }), hitRateCell(u.hit_rate));
  }));
}
