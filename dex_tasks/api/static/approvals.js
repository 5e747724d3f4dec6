// The approval page: reads the session's snapshot, renders a card per pending call and per
// decision, and stays current through the session's Server-Sent Events stream. No framework and
// no build step. Every value from the server goes into the page with textContent, never as HTML.
"use strict";

(function () {
  const parts = location.pathname.split("/");
  const sessionId = decodeURIComponent(parts[2] || "");
  const token = new URLSearchParams(location.search).get("token") || "";
  const base = "/sessions/" + encodeURIComponent(sessionId);

  // Names the store writes; EventSource only delivers named events we listen for.
  const EVENT_NAMES = [
    "tool_call_requested", "tool_call_awaiting_approval", "tool_call_queued",
    "tool_call_started", "tool_call_finished",
  ];
  const ACTIVITY_LIMIT = 50;

  const $ = (id) => document.getElementById(id);
  const pendingCards = new Map();   // interrupt_id -> element
  const decidedCards = new Map();   // interrupt_id -> element
  let serverOffsetMs = 0;           // server clock minus browser clock
  let refreshTimer = null;
  let refreshing = null;
  let fatal = false;

  $("session-id").textContent = sessionId;

  // -- helpers -----------------------------------------------------------------------------

  function serverNow() { return Date.now() + serverOffsetMs; }

  function parseTime(value) {
    if (value === null || value === undefined) return null;
    if (typeof value === "number") return value * 1000;
    const ms = Date.parse(value);
    return Number.isNaN(ms) ? null : ms;
  }

  function clock(ms) {
    return ms === null ? "" : new Date(ms).toLocaleTimeString([], { hour12: false });
  }

  function span(seconds) {
    seconds = Math.max(0, Math.floor(seconds));
    const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600);
    const m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    if (m) return m + "m " + String(s).padStart(2, "0") + "s";
    return s + "s";
  }

  function ago(ms) {
    return ms === null ? "" : span((serverNow() - ms) / 1000) + " ago";
  }

  function pretty(value) {
    try { return JSON.stringify(value, null, 2); } catch (e) { return String(value); }
  }

  function setText(root, selector, text) {
    root.querySelector(selector).textContent = text;
  }

  function banner(text, kind) {
    const el = $("banner");
    el.textContent = text || "";
    el.dataset.kind = kind || "error";
    el.hidden = !text;
  }

  function live(state, text) {
    $("live").dataset.state = state;
    $("live-text").textContent = text;
  }

  async function api(path, options) {
    const headers = Object.assign({ "Authorization": "Bearer " + token },
                                  (options && options.headers) || {});
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status === 401 || response.status === 403) {
      fatal = true;
      let detail = "";
      try { detail = (await response.json()).detail || ""; } catch (e) { /* not JSON */ }
      banner((response.status === 401
        ? "This link's token is missing, invalid or expired. Ask for a new link. "
        : "This token is for another session. ") + detail);
      live("closed", "signed out");
      if (events) events.close();
      throw new Error("auth " + response.status);
    }
    return response;
  }

  // -- rendering ---------------------------------------------------------------------------

  function effectBadge(el, effect) {
    el.textContent = effect;
    el.dataset.effect = effect;
  }

  // A card from its template, filled with what every card shows of the call.
  function newCard(templateId, item) {
    const card = $(templateId).content.firstElementChild.cloneNode(true);
    card.dataset.interruptId = item.interrupt_id;
    card.dataset.key = item.key;
    setText(card, ".tool", item.tool);
    effectBadge(card.querySelector(".effect"), item.effect);
    setText(card, ".key", item.key);
    setText(card, ".args", pretty(item.arguments));
    return card;
  }

  function renderPending(item, callsByKey) {
    let card = pendingCards.get(item.interrupt_id);
    if (!card) {
      card = newCard("pending-card", item);
      card.querySelector(".approve").addEventListener("click", () => decide(card, true));
      card.querySelector(".reject").addEventListener("click", () => decide(card, false));
      pendingCards.set(item.interrupt_id, card);
      $("pending").appendChild(card);
    }
    card.dataset.deadline = item.deadline === null || item.deadline === undefined
      ? "" : String(parseTime(item.deadline));
    card.dataset.created = String(parseTime(item.created_at));
    const call = callsByKey.get(item.key);
    card.dataset.status = call ? call.status : "awaiting_approval";
    tickCard(card);
  }

  function tickCard(card) {
    const created = Number(card.dataset.created);
    card.querySelector(".requested").textContent =
      "requested " + clock(created) + " (" + ago(created) + ")";
    const countdown = card.querySelector(".countdown");
    if (!card.dataset.deadline) {
      countdown.textContent = "no deadline";
      countdown.dataset.urgency = "none";
      return;
    }
    const left = (Number(card.dataset.deadline) - serverNow()) / 1000;
    if (left <= 0) {
      countdown.textContent = "deadline passed";
      countdown.dataset.urgency = "over";
      // The server refuses a late approval anyway; say so instead of offering it.
      if (!card.dataset.busy) {
        card.querySelector(".approve").disabled = true;
        card.querySelector(".reject").disabled = true;
        showNote(card, "The deadline passed: this call is being rejected.");
      }
    } else {
      countdown.textContent = "expires in " + span(left);
      countdown.dataset.urgency = left < 60 ? "soon" : "ok";
    }
    countdown.title = "deadline " + new Date(Number(card.dataset.deadline)).toLocaleString();
  }

  function showNote(card, text) {
    const note = card.querySelector(".note");
    note.textContent = text;
    note.hidden = !text;
  }

  function outcomeText(call) {
    if (!call) return "";
    if (call.error) return call.error;
    if (call.result !== null && call.result !== undefined) return pretty(call.result);
    return "";
  }

  function renderDecided(item, callsByKey) {
    let card = decidedCards.get(item.interrupt_id);
    if (!card) {
      card = newCard("decided-card", item);
      decidedCards.set(item.interrupt_id, card);
    }
    const call = callsByKey.get(item.key);
    const status = call ? call.status : item.call_status;
    const decision = card.querySelector(".decision");
    decision.textContent = item.decision;
    decision.dataset.decision = item.decision;
    const statusEl = card.querySelector(".call-status");
    statusEl.textContent = status;
    statusEl.dataset.status = status;
    // A rejected or expired call's status says the same as its decision badge.
    statusEl.hidden = status === "rejected" && item.decision !== "approved";
    card.dataset.status = status;
    card.dataset.decision = item.decision;
    const when = parseTime(item.decided_at);
    const who = item.decision === "expired"
      ? "expired at the deadline"
      : item.decision + " by " + (item.decided_by || "an unnamed token holder");
    setText(card, ".who", who + " · " + clock(when) + " (" + ago(when) + ")");
    const reason = card.querySelector(".reason");
    reason.textContent = item.reason || "";
    reason.hidden = !item.reason;
    const outcome = card.querySelector(".outcome");
    // A rejected call's error repeats the reason shown above.
    const text = item.decision === "approved" ? outcomeText(call) : "";
    outcome.textContent = text;
    outcome.hidden = !text;
    outcome.dataset.kind = call && call.error ? "error" : "result";
    const outcomeLabel = card.querySelector(".outcome-label");
    outcomeLabel.textContent = call && call.error ? "Error" : "Result";
    outcomeLabel.hidden = !text;
    return card;
  }

  function render(snapshot) {
    const callsByKey = new Map(snapshot.tool_calls.map((c) => [c.key, c]));
    const pendingIds = new Set();
    for (const item of snapshot.pending_interrupts) {
      pendingIds.add(item.interrupt_id);
      renderPending(item, callsByKey);
    }
    for (const [id, card] of pendingCards) {
      if (!pendingIds.has(id)) { card.remove(); pendingCards.delete(id); }
    }
    // Newest decision first.
    const decided = snapshot.decided.slice().sort(
      (a, b) => (parseTime(b.decided_at) || 0) - (parseTime(a.decided_at) || 0));
    const list = $("decided");
    decided.forEach((item, index) => {
      const card = renderDecided(item, callsByKey);
      if (list.children[index] !== card) list.insertBefore(card, list.children[index] || null);
    });
    $("pending-count").textContent = String(pendingCards.size);
    $("decided-count").textContent = String(decided.length);
    $("pending-empty").hidden = pendingCards.size > 0;
    $("decided-empty").hidden = decided.length > 0;
    document.body.dataset.loaded = "true";
  }

  async function refresh() {
    if (fatal) return;
    if (refreshing) { scheduleRefresh(); return; }  // coalesce with the one in flight
    refreshing = (async () => {
      try {
        const response = await api(base + "/snapshot");
        if (!response.ok) throw new Error("snapshot: HTTP " + response.status);
        const serverTime = Number(response.headers.get("X-Server-Time"));
        if (serverTime) serverOffsetMs = serverTime * 1000 - Date.now();
        render(await response.json());
        if ($("banner").dataset.kind === "stale") banner("");
      } catch (err) {
        if (!fatal) banner("Could not load the session (" + err.message + "); retrying.", "stale");
      } finally {
        refreshing = null;
      }
    })();
    return refreshing;
  }

  function scheduleRefresh() {
    // Events come in bursts (queued, started, finished): one snapshot read per burst.
    if (refreshTimer) return;
    refreshTimer = setTimeout(() => { refreshTimer = null; refresh(); }, 150);
  }

  // -- decisions ---------------------------------------------------------------------------

  async function decide(card, approved) {
    const message = card.querySelector(".reject-message").value.trim();
    card.dataset.busy = "true";
    card.querySelectorAll("button, input").forEach((el) => { el.disabled = true; });
    showNote(card, approved ? "Approving..." : "Rejecting...");
    try {
      const response = await api("/interrupts/resolve", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({
          session_id: sessionId,
          interrupt_id: card.dataset.interruptId,
          approved: approved,
          rejection_message: approved || !message ? null : message,
        }),
      });
      const body = await response.json();
      if (!response.ok) throw new Error(body.message || body.detail || "HTTP " + response.status);
      if (!body.accepted) {
        showNote(card, "Not applied: someone else decided first, or the deadline passed.");
      }
    } catch (err) {
      if (!fatal) {
        showNote(card, "Failed: " + err.message);
        delete card.dataset.busy;
        card.querySelectorAll("button, input").forEach((el) => { el.disabled = false; });
      }
    }
    await refresh();
  }

  // -- live updates ------------------------------------------------------------------------

  function addActivity(event) {
    const data = JSON.parse(event.data);
    const li = document.createElement("li");
    const time = document.createElement("span");
    time.className = "time mono";
    time.textContent = clock(parseTime(data.created_at));
    const name = document.createElement("span");
    name.className = "event-name";
    name.dataset.event = event.type;
    name.textContent = event.type.replace(/_/g, " ");
    const key = document.createElement("span");
    key.className = "mono";
    key.textContent = data.key + (data.to_status ? "  →  " + data.to_status : "");
    li.append(time, name, key);
    li.dataset.cursor = event.lastEventId;
    const list = $("activity");
    list.prepend(li);
    while (list.children.length > ACTIVITY_LIMIT) list.lastElementChild.remove();
  }

  let events = null;

  function connect() {
    // EventSource cannot send an Authorization header: the token goes in the query string.
    events = new EventSource(base + "/events?token=" + encodeURIComponent(token));
    events.onopen = () => { live("live", "live"); scheduleRefresh(); };
    events.onerror = () => {
      if (events.readyState === EventSource.CLOSED) {
        // The server refused the stream (a 401/403 is not retried by the browser).
        live("closed", "disconnected");
        refresh();
      } else {
        live("reconnecting", "reconnecting");
      }
    };
    for (const name of EVENT_NAMES) {
      events.addEventListener(name, (event) => { addActivity(event); scheduleRefresh(); });
    }
  }

  if (!token) {
    banner("This page needs its link's ?token=... part. Ask for a new link.");
    live("closed", "signed out");
    return;
  }
  refresh().then(() => { if (!fatal) connect(); });
  setInterval(() => { for (const card of pendingCards.values()) tickCard(card); }, 1000);
})();
