// celery_redlock's dashboard: polls each panel's JSON view every second and redraws it.
//
// Every value shown comes from the lock nodes, and lock names, task names and ids are
// chosen by whoever sends tasks: they are only ever set as text (textContent), never
// parsed as HTML.
"use strict";

/** How often every panel is read again, in ms. */
const REFRESH_MS = 1000;

/** Set from /api/meta before the first draw. */
let meta = { allow_release: false, nodes: [] };
/** The task id the search box shows, if any (read again at every refresh). */
let searched = null;
/** The lock key whose history is shown, if any (read again at every refresh). */
let historyKey = null;

// ------------------------------------------------------------------ small helpers

/** An element with attributes (`text` sets its text, `on*` adds a listener). */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
  }
  return node;
}

/** Seconds as `ls` prints them: 4.2s, 3m07s, 5h02m, 3d04h (`-` for none). */
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 0) return seconds === -1 ? "none" : "0s";
  if (seconds < 60) return `${seconds.toFixed(1)}s`;
  const pad = (n) => String(n).padStart(2, "0");
  let minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes}m${pad(Math.floor(seconds) % 60)}s`;
  let hours = Math.floor(minutes / 60);
  minutes %= 60;
  if (hours < 48) return `${hours}h${pad(minutes)}m`;
  return `${Math.floor(hours / 24)}d${pad(hours % 24)}h`;
}

/** A due time: "now" when due, else "in 4.2s". */
function due(seconds) {
  return seconds <= 0 ? "now" : `in ${duration(seconds)}`;
}

/** A task id that searches for itself when clicked. */
function taskLink(taskId) {
  if (!taskId) return el("span", { class: "dim", text: "-" });
  return el("a", {
    href: "#", class: "task-id mono", "data-task-id": taskId, text: taskId,
    onclick: (event) => { event.preventDefault(); search(taskId); },
  });
}

/** A lock key that shows its history (the event log) when clicked. */
function keyLink(key) {
  return el("a", {
    href: "#", class: "key-link mono", "data-history-key": key, text: key,
    onclick: (event) => { event.preventDefault(); showHistory(key); },
  });
}

/** Events (the log's view) as a table: time (UTC, node clock), task id, what happened. */
function eventsTable(events, withKey) {
  const columns = [["Time (UTC)", (e) => e.time, "mono num"]];
  if (withKey) columns.push(["Key", (e) => (e.key ? keyLink(e.key) : e.k || "-"), "mono key"]);
  columns.push(["Task id", (e) => taskLink(e.id)], ["What happened", (e) => e.text, "wrap"]);
  return table(columns, events, (e) => ({ "data-event": e.e, "data-key": e.key || "",
    "data-task-id": e.id || "" }));
}

/** An events view: unknown when no node answered, a line when empty, else a table. */
function drawEvents(data, emptyText, withKey) {
  if (!data.events) return [incomplete(data)];
  if (!data.events.length) return [empty(emptyText)];
  return [eventsTable([...data.events].reverse(), withKey)];
}

/**
 * A table. `columns` are [title, cell(row) -> string | Node, class?]; `rowAttrs(row)`
 * gives each <tr>'s attributes (data-key, data-task-id: what tests and users select).
 */
function table(columns, rows, rowAttrs) {
  const head = el("tr", {}, ...columns.map(([title]) => el("th", { text: title })));
  const body = rows.map((row) => el("tr", rowAttrs ? rowAttrs(row) : {},
    ...columns.map(([, cell, cls]) => el("td", { class: cls }, cell(row)))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

/** What a view says when too few nodes answered: its items are null then. */
function incomplete(data) {
  const answered = data.nodes.filter((n) => n.ok).length;
  return el("p", { class: "warn", text:
    `Unknown: only ${answered} of ${data.nodes.length} lock node(s) answered, ` +
    `fewer than the ${data.quorum} needed to tell.` });
}

function empty(text) {
  return el("p", { class: "empty", text });
}

/** A view's list as a table; unknown without a quorum (null), or a line when empty. */
function listed(items, data, emptyText, columns, rowAttrs) {
  if (!items) return [incomplete(data)];
  if (!items.length) return [empty(emptyText)];
  return [table(columns, items, rowAttrs)];
}

function nodesCell(item) {
  return item.nodes > 1 ? `${item.held_on}/${item.nodes}` : "";
}

// ------------------------------------------------------------------ the panels

/** Each panel: its JSON view and how to draw it. A new panel is one entry here. */
const PANELS = {
  locks: {
    url: "/api/locks",
    draw(data) {
      if (!data.locks) return [incomplete(data)];
      const parts = [];
      const columns = [
        ["Key", (l) => keyLink(l.key), "mono key"],
        ["Task", (l) => l.task_name || "-", "wrap"],
        ["Task id", (l) => taskLink(l.task_id)],
        ["Worker host", (l) => l.host || "?"],
        ["Pid", (l) => (l.pid === null ? "?" : String(l.pid)), "num"],
        ["Age", (l) => duration(l.age === null ? null : Math.max(l.age, 0)), "num"],
        ["TTL left", (l) => duration(l.ttl), "num"],
        ["Fence", (l) => (l.fence === null ? "-" : String(l.fence)), "num mono"],
      ];
      if (data.locks.some((l) => l.nodes > 1)) {
        columns.push(["Nodes", (l) => `${nodesCell(l)}${l.quorum ? "" : " NO QUORUM"}`]);
      }
      if (meta.allow_release) {
        columns.push(["", (l) => el("button", {
          type: "button", class: "release", "data-key": l.key, text: "Release",
          onclick: () => release(l.key),
        })]);
      }
      const attrs = (l) => ({ "data-key": l.key, "data-task-id": l.task_id || "" });
      parts.push(data.locks.length ? table(columns, data.locks, attrs) : empty("No locks held."));
      if (data.shares.length) {
        parts.push(el("h3", { text: "Shares (lock_mode=\"shared\", lock_limit)" }));
        parts.push(table(columns.slice(0, 8), data.shares, attrs));
      }
      return parts;
    },
  },

  queued: {
    url: "/api/queued",
    draw(data) {
      if (!data.waiting) return [incomplete(data)];
      const parts = [];
      if (data.waiting.length) {
        parts.push(el("h3", { text: "On the queue for a key" }));
        parts.push(table([
          ["Task id", (r) => taskLink(r.task_id)],
          ["Key", (r) => r.key, "mono key"],
          ["Due", (r) => due(r.due_in), "num"],
          ["Place", (r) => String(r.place), "num"],
        ], data.waiting, (r) => ({ "data-task-id": r.task_id })));
      }
      if (data.parked.length) {
        parts.push(el("h3", { text: "Parked until their turn" }));
        parts.push(table([
          ["Task id", (r) => taskLink(r.task_id)],
          ["Task", (r) => r.task_name || "-"],
          ["Waits for", (r) => r.waits_for],
          ["Key", (r) => r.key || "-", "mono key"],
          ["Due", (r) => due(r.due_in), "num"],
          ["Published", (r) => String(r.taken), "num"],
        ], data.parked, (r) => ({ "data-task-id": r.task_id })));
      }
      return parts.length ? parts : [empty("No run is waiting.")];
    },
  },

  budgets: {
    url: "/api/budgets",
    draw(data) {
      return listed(data.budgets, data, "No rate budget in use.", [
        ["Key", (b) => b.key, "mono key"],
        ["Used / limit", (b) => (b.limit === null ? "-" : `${b.used}/${b.limit} (${b.rate})`), "num"],
        ["Next free", (b) => (b.next_free === null ? "-" : due(b.next_free)), "num"],
        ["Queued", (b) => String(b.queued), "num"],
      ], (b) => ({ "data-key": b.key }));
    },
  },

  claims: {
    url: "/api/claims",
    draw(data) {
      return listed(data.claims, data, "No queued copy claims a key.", [
        ["Key", (c) => c.key, "mono key"],
        ["Task", (c) => c.task_name || "-"],
        ["Task id", (c) => taskLink(c.task_id)],
        ["Age", (c) => duration(c.age === null ? null : Math.max(c.age, 0)), "num"],
        ["TTL", (c) => duration(c.ttl), "num"],
      ], (c) => ({ "data-key": c.key, "data-task-id": c.task_id }));
    },
  },

  leader: {
    url: "/api/leader",
    draw(data) {
      if (data.error) return [el("p", { class: "warn", text: data.error })];
      if (!data.leader) return [incomplete(data)];
      const leader = data.leader;
      const key = el("p", {}, "Lock ", el("code", { text: leader.key }));
      if (!leader.held) return [key, empty("No beat leads: the lock is free.")];
      const holder = leader.holder;
      const who = leader.beat
        ? `beat of app ${leader.beat.app} on ${leader.beat.host}, pid ${leader.beat.pid}`
        : holder.task_name || "an unknown holder";
      return [key, el("dl", {},
        el("dt", { text: "Held by" }), el("dd", { text: who }),
        el("dt", { text: "For" }), el("dd", { text: duration(holder.age) }),
        el("dt", { text: "TTL left" }), el("dd", { text: duration(holder.ttl) }),
        el("dt", { text: "Fence" }), el("dd", { class: "mono", text: String(holder.fence) }))];
    },
  },
  events: {
    url: "/api/events",
    draw(data) {
      return drawEvents(data, "No event logged yet (redlock_events, the last hour).", true);
    },
  },
};

// ------------------------------------------------------------------ a key's history

function showHistory(key) {
  historyKey = key || null;
  const section = document.getElementById("key-history");
  section.hidden = !historyKey;
  if (historyKey) {
    document.getElementById("key-history-key").textContent = historyKey;
    section.querySelector(".body").replaceChildren(empty("Reading…"));
    refreshHistory();
  }
}

async function refreshHistory() {
  const key = historyKey;
  if (!key) return;
  const data = await getJSON(`/api/log/${encodeURIComponent(key)}`);
  if (key === historyKey) {
    document.querySelector("#key-history .body").replaceChildren(
      ...drawEvents(data, "No event of this key is kept.", false));
  }
}

// ------------------------------------------------------------------ the task search

/** Lines saying where a task stands, as `inspect TASK_ID` prints them. */
function drawTask(data) {
  if (!data.task) return [incomplete(data)];
  const task = data.task;
  if (!task.found) {
    return [empty("Not on the lock nodes: this task holds no lock, claims no key and is " +
      "not parked (it may be on the broker's queue, running without a lock, or done).")];
  }
  const lines = [];
  for (const lock of task.holds) {
    lines.push(el("li", { class: "holds" }, "holds ", el("code", { text: lock.key }),
      ` (${lock.task_name || "-"}) on ${lock.host || "?"}:${lock.pid ?? "?"}, ` +
      `fence ${lock.fence}, TTL ${duration(lock.ttl)}`));
  }
  for (const claim of task.claims) {
    lines.push(el("li", { class: "claims" }, "claims ", el("code", { text: claim.key }),
      `: its queued copy keeps the key (${claim.task_name || "-"})`));
  }
  for (const run of task.parked) {
    lines.push(el("li", { class: "parked" }, `parked on ${run.node}: waits for ${run.waits_for} of `,
      el("code", { text: run.key || "-" }), `, due ${due(run.due_in)}` +
      (run.taken ? `, published ${run.taken} time(s), not started yet` : "")));
  }
  for (const [node, error] of Object.entries(task.errors)) {
    lines.push(el("li", { class: "warn", text: `${node}: ${error} (what it holds is not shown)` }));
  }
  return [el("ul", {}, ...lines)];
}

function search(taskId) {
  searched = taskId.trim() || null;
  document.getElementById("task-search").value = searched || "";
  const section = document.getElementById("task-result");
  section.hidden = !searched;
  if (searched) {
    document.getElementById("task-result-id").textContent = searched;
    section.querySelector(".body").replaceChildren(empty("Reading…"));
    refreshTask();
  }
}

/** A task id's story from the event log (`why`): its summary, then its events. */
function drawStory(data) {
  if (!data.events) return [incomplete(data)];
  const parts = [el("p", { class: "summary", text: data.summary })];
  if (data.events.length) parts.push(eventsTable(data.events, true));
  return [el("h3", { text: "Story (event log)" }), ...parts];
}

async function refreshTask() {
  const taskId = searched;
  if (!taskId) return;
  const id = encodeURIComponent(taskId);
  const [data, story] = await Promise.all([getJSON(`/api/task/${id}`), getJSON(`/api/why/${id}`)]);
  if (taskId === searched) {
    document.querySelector("#task-result .body").replaceChildren(
      el("h3", { text: "Now" }), ...drawTask(data), ...drawStory(story));
  }
}

// ------------------------------------------------------------------ release

function say(text, kind) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = `message ${kind}`;
  box.hidden = false;
}

async function postRelease(key, force) {
  const response = await fetch("/api/release", {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key, force }),
  });
  return { status: response.status, body: await response.json() };
}

/** As `celery redlock release KEY`: asks first; a running holder needs a second yes. */
async function release(key) {
  if (!window.confirm(`Release ${key}?`)) return;
  let reply = await postRelease(key, false);
  if (reply.status === 409) {
    const reasons = reply.body.refused.map((r) => `${r.key}: ${r.reason}`).join("\n");
    if (!window.confirm(`Refused:\n${reasons}\n\nRelease anyway (force)?`)) {
      say(`Not released: ${reasons}`, "warn");
      return;
    }
    reply = await postRelease(key, true);
  }
  if (reply.status === 200) {
    const done = reply.body.released.map((r) => `${r.key} (fence ${r.fence})`);
    const cleared = reply.body.cleared.length ? `; cleared ${reply.body.cleared.length} claim(s)` : "";
    say(`Released ${done.join(", ") || "nothing"}${cleared}.`, "ok");
  } else {
    say(`Not released (${reply.status}): ${reply.body.error || JSON.stringify(reply.body.refused)}`, "warn");
  }
  refresh();
}

// ------------------------------------------------------------------ the loop

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

async function refreshPanel(section) {
  const panel = PANELS[section.dataset.panel];
  const data = await getJSON(panel.url);
  section.querySelector(".body").replaceChildren(...panel.draw(data));
  return data;
}

async function refresh() {
  const status = document.getElementById("status");
  const sections = [...document.querySelectorAll("section[data-panel]")];
  try {
    const views = await Promise.all([...sections.map(refreshPanel), refreshTask(),
      refreshHistory()]);
    const nodes = views[0].nodes;
    document.getElementById("nodes").textContent = nodes
      .map((n) => `${n.node} ${n.ok ? "ok" : "DOWN"}`).join(", ");
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
    status.className = nodes.every((n) => n.ok) ? "status ok" : "status warn";
  } catch (error) {
    status.textContent = `disconnected: ${error.message}`;
    status.className = "status error";
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, REFRESH_MS);
}

async function start() {
  meta = await getJSON("/api/meta");
  document.getElementById("app-name").textContent = meta.app;
  document.getElementById("search").addEventListener("submit", (event) => {
    event.preventDefault();
    search(document.getElementById("task-search").value);
  });
  document.getElementById("task-close").addEventListener("click", () => search(""));
  document.getElementById("history-close").addEventListener("click", () => showHistory(""));
  loop();
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch((error) => {
    const status = document.getElementById("status");
    status.textContent = `cannot start: ${error.message}`;
    status.className = "status error";
  });
});
