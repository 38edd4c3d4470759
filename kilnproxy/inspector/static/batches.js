// The "Batches" view: every org's batches, newest first, with their status, counts and progress.
// Uses app.js's helpers (api, el, $, textCell); the JSON endpoint is in docs/inspector.md.
"use strict";

const batchesState = { timer: null };

async function showBatches(hash) {
  const match = hash.match(/^#\/batches\/(.+)$/);
  const selected = match ? decodeURIComponent(match[1]) : null;  // a request's batch, from its detail
  const batches = (await api("/ui/api/batches")).data;
  $("batches-table").tBodies[0].replaceChildren(...batches.map((b) => {
    const counts = b.request_counts;
    const bar = el("progress", { max: "1", value: String(b.progress), title: `${Math.round(b.progress * 100)} %` });
    return el("tr", { "data-batch": b.id, class: b.id === selected ? "selected" : "" },
      el("td", { text: new Date(b.created_at * 1000).toLocaleString([], { hour12: false }) }),
      textCell(b.id), textCell(b.org), el("td", { text: b.endpoint }),
      el("td", { class: `status ${b.status === "failed" || b.status === "expired" ? "s-err" : ""}`, text: b.status }),
      el("td", { class: "num total", text: String(counts.total) }),
      el("td", { class: "num completed", text: String(counts.completed) }),
      el("td", { class: "num failed", text: String(counts.failed) }), el("td", {}, bar));
  }));
  $("batches-empty").hidden = batches.length > 0;
  clearTimeout(batchesState.timer);  // batches move on their own: read again every 2 s while the view is open
  batchesState.timer = setTimeout(() => { if (!$("view-batches").hidden) showBatches(location.hash).catch(() => {}); },
                                  2000);
}
