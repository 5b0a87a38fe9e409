// credpool dashboard. The admin key lives in this tab's sessionStorage and is sent only as the
// X-Admin-Key header: to fetch the fragments (every POLL_MS) and to call the operator API.
"use strict";

const KEY = "credpool-admin-key";
const FRAGMENTS = ["pools", "credentials", "leases", "events"];
const POLL_MS = 3000;

// The credentials table's sort, kept across refreshes.
let sort = { column: 0, type: "text", descending: false };

const $ = (id) => document.getElementById(id);

function setStatus(text) {
  $("status").textContent = text;
}

function showLogin(message) {
  $("board").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-message").textContent = message || "";
}

async function adminFetch(path, options = {}) {
  const headers = Object.assign({ "X-Admin-Key": sessionStorage.getItem(KEY) }, options.headers);
  return fetch(path, Object.assign({ cache: "no-store" }, options, { headers }));
}

// One refresh at a time: a slow answer is not overtaken by the next poll's.
let refreshing = false;

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  try {
    await load();
  } finally {
    refreshing = false;
  }
}

async function load() {
  if (!sessionStorage.getItem(KEY)) {
    showLogin();
    return;
  }
  let responses;
  try {
    responses = await Promise.all(FRAGMENTS.map((name) => adminFetch("/dashboard/fragments/" + name)));
  } catch (error) {
    setStatus("credpool unreachable; retrying");
    return;
  }
  if (responses.some((r) => r.status === 401 || r.status === 403)) {
    sessionStorage.removeItem(KEY);
    showLogin("That key was refused: paste the admin key (CREDPOOL_ADMIN_KEY).");
    return;
  }
  const bodies = await Promise.all(responses.map((r) => r.text()));
  FRAGMENTS.forEach((name, i) => {
    if (responses[i].ok) {
      $(name).innerHTML = bodies[i];
    }
  });
  arrangeCredentials();
  $("login").hidden = true;
  $("board").hidden = false;
  $("forget").hidden = false;
  const failed = FRAGMENTS.filter((_, i) => !responses[i].ok);
  setStatus(failed.length ? "could not load: " + failed.join(", ") : "live, updated " + new Date().toLocaleTimeString());
}

// Client-side filter and sort of the credentials table, reapplied after every refresh.
function arrangeCredentials() {
  const table = $("credentials-table");
  if (!table) return;
  const text = $("filter").value.trim().toLowerCase();
  const status = $("status-filter").value;
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  for (const row of rows) {
    const matches = row.dataset.search.toLowerCase().includes(text)
      && (!status || row.dataset.status.split(" ").includes(status));
    row.hidden = !matches;
  }
  const value = (row) => row.cells[sort.column].dataset.sort;
  rows.sort((a, b) => {
    const order = sort.type === "number"
      ? Number(value(a)) - Number(value(b))
      : value(a).localeCompare(value(b));
    return sort.descending ? -order : order;
  });
  body.append(...rows);
  for (const th of table.tHead.rows[0].cells) {
    th.classList.toggle("sorted", Number(th.dataset.column) === sort.column && th.dataset.column !== undefined);
    th.classList.toggle("descending", sort.descending);
  }
}

// Operator actions: each calls the operator API, then refreshes at once.
const ACTIONS = {
  drain: (el) => ({
    method: "PATCH", path: "/api/admin/keys/" + encodeURIComponent(el.dataset.keyId),
    body: { state: "drain", reason: "drained from the dashboard" },
  }),
  enable: (el) => ({
    method: "PATCH", path: "/api/admin/keys/" + encodeURIComponent(el.dataset.keyId),
    body: { state: "enable", reason: "enabled from the dashboard" },
  }),
  disable: (el) => ({
    confirm: "Disable " + el.dataset.keyId + "? It gets no new leases until enabled.",
    method: "PATCH", path: "/api/admin/keys/" + encodeURIComponent(el.dataset.keyId),
    body: { state: "disable", reason: "disabled from the dashboard" },
  }),
  "release-all": (el) => ({
    confirm: "Force-release every lease of " + el.dataset.keyId + "? Their holders lose them.",
    method: "POST", path: "/api/admin/keys/" + encodeURIComponent(el.dataset.keyId) + "/release-all",
    body: { reason: "force-released from the dashboard" },
  }),
  release: (el) => ({
    confirm: "Force-release lease " + el.dataset.leaseId + "? Its holder loses it.",
    method: "POST", path: "/api/admin/leases/" + encodeURIComponent(el.dataset.leaseId) + "/release",
    body: { reason: "force-released from the dashboard" },
  }),
};

async function act(el) {
  const action = ACTIONS[el.dataset.action](el);
  if (action.confirm && !window.confirm(action.confirm)) return;
  const response = await adminFetch(action.path, {
    method: action.method,
    headers: { "Content-Type": "application/json", "X-Operator": "dashboard" },
    body: JSON.stringify(action.body),
  });
  if (response.ok) {
    setStatus(el.dataset.action + ": done");
  } else {
    const error = await response.json().catch(() => ({}));
    setStatus(el.dataset.action + " failed: " + ((error.error && error.error.message) || response.status));
  }
  await refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-input").value = "";
    refresh();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    showLogin();
  });
  $("filter").addEventListener("input", arrangeCredentials);
  $("status-filter").addEventListener("change", arrangeCredentials);
  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button) {
      act(button);
      return;
    }
    const th = event.target.closest("#credentials-table th[data-column]");
    if (th) {
      const column = Number(th.dataset.column);
      sort = { column, type: th.dataset.type, descending: sort.column === column && !sort.descending };
      arrangeCredentials();
    }
  });
  refresh();
  setInterval(refresh, POLL_MS);
});
