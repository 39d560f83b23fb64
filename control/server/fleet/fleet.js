// The fleet page: asks for an API key, then shows fleet.overview every 5 s. Every value is put on the page as
// text (never as HTML): hostnames and errors come from nodes and BMCs.
"use strict";

const KEY = "bc-fleet-key";
const REFRESH_MS = 5000;
const DEADLINE_MS = 10000;
const $ = (id) => document.getElementById(id);
let timer = null;
let view = "nodes";

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return s + "s";
  const m = Math.floor(s / 60);
  if (m < 60) return m + "m " + (s % 60) + "s";
  const h = Math.floor(m / 60);
  if (h < 48) return h + "h " + (m % 60) + "m";
  return Math.floor(h / 24) + "d " + (h % 24) + "h";
}

function ago(at, ms) {
  return ms === null || ms === undefined ? "never" : duration(at - ms) + " ago";
}

function card(title, total, rows) {
  const c = el("div", null, "card");
  c.dataset.card = title.toLowerCase();
  c.append(el("h3", title), el("div", total, "big"));
  const dl = el("dl");
  for (const [k, v] of rows) {
    const dd = el("dd", v);
    dd.dataset.count = k;
    dl.append(el("dt", k), dd);
  }
  c.append(dl);
  return c;
}

function sum(map) {
  return Object.values(map).reduce((a, b) => a + b, 0);
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.append(c instanceof Node ? c : el("td", c));
  return tr;
}

function fill(tbody, rows, empty, columns) {
  tbody.replaceChildren(...rows);
  if (rows.length === 0) {
    const td = el("td", empty, "empty");
    td.colSpan = columns;
    tbody.append(el("tr")).append(td);
  }
}

function render(o) {
  const c = o.counts;
  const counts = $("counts");
  counts.replaceChildren(
    card("Nodes", sum(c.nodes), Object.entries(c.nodes).concat([["online", c.nodes_online]])),
    card("GPUs", c.gpus.total, [["free", c.gpus.free], ["booked", c.gpus.booked]]),
    card("Reservations", sum(c.reservations), Object.entries(c.reservations)),
    card("Machines", sum(c.machines), Object.entries(c.machines).filter(([k, v]) => v > 0 || k === "failed")),
  );
  fill($("nodes"), o.nodes.map((n) => row([
    el("td", n.id), el("td", n.hostname), el("td", n.pool),
    el("td", n.state, "state-" + n.state), el("td", n.online ? "yes" : "no", n.online ? "online-yes" : "online-no"),
    el("td", n.gpus_free, "num"), el("td", n.gpus_booked, "num"), el("td", n.gpu_model),
    el("td", ago(o.at_ms, n.last_seen_ms)), el("td", n.conditions.join("; "), "wrap"),
  ])), "No nodes.", 10);
  fill($("in-flight"), o.in_flight.map((m) => {
    const left = m.deadline_ms === null ? null : m.deadline_ms - o.at_ms;
    const deadline = left === null ? el("td", "none")
      : left >= 0 ? el("td", "in " + duration(left)) : el("td", "overdue by " + duration(-left), "overdue");
    return row([el("td", m.mac), el("td", m.site), el("td", m.phase), el("td", m.attempt, "num"),
      el("td", duration(o.at_ms - m.phase_started_ms)), deadline, el("td", m.waiting_for || "", "wrap")]);
  }), "Nothing in flight.", 7);
  fill($("failures"), o.failures.map((f) => row([
    el("td", f.kind), el("td", f.id), el("td", f.at), el("td", f.error, "wrap"),
  ])), "No failures.", 4);
  for (const tab of document.querySelectorAll(".tab")) {
    const n = { "nodes": o.nodes.length, "in-flight": o.in_flight.length, "failures": o.failures.length }[tab.dataset.view];
    tab.textContent = tab.textContent.replace(/ \(\d+\)$/, "") + " (" + n + ")";
  }
  $("status").textContent = "Updated " + new Date(o.at_ms).toISOString().replace("T", " ").slice(0, 19) + " UTC";
  document.body.dataset.loaded = String(o.at_ms);
}

function show(signedIn, message) {
  $("sign-in").hidden = signedIn;
  $("fleet").hidden = !signedIn;
  $("sign-out").hidden = !signedIn;
  $("sign-in-error").textContent = message || "";
  if (!signedIn) {
    $("status").textContent = "";
    $("key").focus();
  }
}

async function refresh() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY);
  if (!key) return show(false);
  const abort = new AbortController();
  const deadline = setTimeout(() => abort.abort(), DEADLINE_MS);
  try {
    const r = await fetch("/api/compute/fleet/overview", {
      signal: abort.signal,
      method: "POST",
      headers: { "Authorization": "Bearer " + key, "Content-Type": "application/json" },
      body: "{}",
      cache: "no-store",
      credentials: "omit",
      referrerPolicy: "no-referrer",
    });
    const body = await r.json();
    if (r.status === 401 || r.status === 403) {
      sessionStorage.removeItem(KEY);
      return show(false, body.code + ": " + body.message);
    }
    if (!r.ok) throw new Error(body.code + ": " + body.message);
    show(true);
    render(body);
  } catch (e) {
    const why = e.name === "AbortError" ? "no answer within " + DEADLINE_MS / 1000 + " s" : e.message;
    $("status").textContent = "Refresh failed (" + why + "); retrying";
  } finally {
    clearTimeout(deadline);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function select(name) {
  view = name;
  for (const tab of document.querySelectorAll(".tab")) {
    tab.setAttribute("aria-selected", String(tab.dataset.view === name));
  }
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + name;
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key").value.trim();
    $("key").value = "";
    if (key) sessionStorage.setItem(KEY, key);
    refresh();
  });
  $("sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    clearTimeout(timer);
    show(false);
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => select(tab.dataset.view));
  }
  select(view);
  refresh();
});
