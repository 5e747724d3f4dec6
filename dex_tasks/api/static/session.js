// The session page: reads the session's snapshot, renders its transcript, a card per pending
// call and per decision, and stays current through the session's Server-Sent Events stream. No
// framework and no build step. Every value from the server goes into the page with
// textContent, never as HTML, and with its control and bidi characters shown as escapes
// (visible): "\u202e00001 :tnuoma" must not display as "amount: 10000". Who the reader works as
// (approver, permission) is rendered by the server; a token without "operate" gets the page
// without Approve/Reject.
//
// The page reads the session in bounded pieces: first the transcript's newest messages, the
// calls not ended yet, the approvals waiting and the newest decisions; then, after each burst
// of events, only the messages after the last one it has (and the same bounded lists), never
// the whole session again. Its event stream starts at the snapshot's event_cursor.
"use strict";

(function () {
  const parts = location.pathname.split("/");
  const sessionId = decodeURIComponent(parts[2] || "");
  const token = new URLSearchParams(location.search).get("token") || "";
  const base = "/sessions/" + encodeURIComponent(sessionId);
  const canOperate = document.body.dataset.canOperate === "true";
  const clockTime = window.dexClock;

  // Names the store writes; EventSource only delivers named events we listen for.
  const EVENT_NAMES = [
    "tool_call_requested", "tool_call_awaiting_approval", "tool_call_queued",
    "tool_call_started", "tool_call_finished", "tool_call_approval_counted",
  ];
  const TERMINAL = new Set(["succeeded", "failed", "rejected", "outcome_unknown"]);
  const ACTIVITY_LIMIT = 50;
  const PAGE_LIMIT = 200;
  const MAX_CURSOR = "9223372036854775807";
  // C0 (but tab and newline) and C1 controls, DEL, the line/paragraph separators, and the
  // bidirectional formatting characters: shown as \uXXXX, never acted on.
  const UNSAFE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;

  const $ = (id) => document.getElementById(id);
  const pendingCards = new Map();   // interrupt_id -> element
  const decidedCards = new Map();   // interrupt_id -> element
  const messageItems = new Map();   // message id -> element
  const toolOutputs = new Map();    // call key -> its tool message (the call's outcome)
  let callsByKey = new Map();       // key -> call, for the calls not ended yet
  let lastMessageId = 0;
  let eventCursor = null;
  let serverOffsetMs = 0;           // server clock minus browser clock
  let refreshTimer = null;
  let refreshing = null;
  let fatal = false;
  let events = null;

  // -- helpers -----------------------------------------------------------------------------

  function serverNow() { return Date.now() + serverOffsetMs; }

  function visible(text) {
    return String(text).replace(UNSAFE,
      (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
  }

  function parseTime(value) {
    if (value === null || value === undefined) return null;
    if (typeof value === "number") return value * 1000;
    const ms = Date.parse(value);
    return Number.isNaN(ms) ? null : ms;
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
    try { return visible(JSON.stringify(value, null, 2)); } catch (e) { return visible(value); }
  }

  // JSON text (a tool's arguments or output) pretty-printed; anything else as it is.
  function prettyText(text) {
    if (text === null || text === undefined) return "";
    try { return pretty(JSON.parse(text)); } catch (e) { return visible(text); }
  }

  function setText(root, selector, text) {
    root.querySelector(selector).textContent = visible(text);
  }

  function show(root, selector, visible) {
    root.querySelector(selector).hidden = !visible;
  }

  function badge(el, kind, value) {
    el.textContent = visible(value || "");
    el.dataset[kind] = value || "";
    el.hidden = !value;
  }

  function banner(text, kind) {
    const el = $("banner");
    el.textContent = visible(text || "");
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
        : "This token does not allow that. ") + visible(detail));
      live("closed", "signed out");
      if (events) events.close();
      throw new Error("auth " + response.status);
    }
    return response;
  }

  // -- approval cards ----------------------------------------------------------------------

  // A card from its template, filled with what every card shows of the call.
  function newCard(templateId, item) {
    const card = $(templateId).content.firstElementChild.cloneNode(true);
    card.dataset.interruptId = item.interrupt_id;
    card.dataset.key = item.key;
    setText(card, ".tool", item.tool);
    badge(card.querySelector(".effect"), "effect", item.effect);
    setText(card, ".key", item.key);
    setText(card, ".args", pretty(item.arguments));
    return card;
  }

  function setDeadline(card, deadlineMs) {
    const line = card.querySelector(".deadline-line");
    line.hidden = deadlineMs === null;
    if (deadlineMs !== null) clockTime.set(card.querySelector(".deadline-clock"), deadlineMs);
  }

  function renderPending(item, callsByKey) {
    let card = pendingCards.get(item.interrupt_id);
    if (!card) {
      card = newCard("pending-card", item);
      if (canOperate) {
        card.querySelector(".approve").addEventListener("click", () => decide(card, true));
        card.querySelector(".reject").addEventListener("click", () => decide(card, false));
      } else {
        // Read-only: no control that would only earn a 403.
        card.querySelector(".actions").remove();
        card.dataset.readOnly = "true";
        showNote(card, "Read-only: your token can view this call but not decide it.");
      }
      pendingCards.set(item.interrupt_id, card);
      $("pending").appendChild(card);
    }
    const deadline = item.deadline === null || item.deadline === undefined
      ? null : parseTime(item.deadline);
    card.dataset.deadline = deadline === null ? "" : String(deadline);
    card.dataset.created = String(parseTime(item.created_at));
    setDeadline(card, deadline);
    // Several approvers: who approved so far, out of how many.
    const needed = item.approvals_required || 1;
    const line = card.querySelector(".approvals-line");
    line.hidden = needed <= 1;
    if (needed > 1) {
      const so = (item.approved_by || []).join(", ") || "nobody yet";
      line.textContent = (item.approved_by || []).length + " of " + needed + " approvals" +
        (item.approver_permission ? " (holding " + item.approver_permission + ")" : "") +
        " · approved so far: " + so;
    }
    // The arguments as they are now, on every snapshot: another approver's edit replaces
    // them, and this card must show (and approve) the version it names.
    const changed = card.dataset.version && card.dataset.version !== item.arguments_version;
    card.dataset.version = item.arguments_version || "";
    setText(card, ".args", pretty(item.arguments));
    const edit = card.querySelector(".edit-args");
    if (edit && !edit.dataset.touched) {
      edit.value = pretty(item.arguments);
      if (!edit.dataset.listening) {
        edit.dataset.listening = "true";
        edit.addEventListener("input", () => { edit.dataset.touched = "true"; }, { once: true });
      }
    }
    if (changed && !card.dataset.busy) {
      showNote(card, "The arguments changed since this card was shown (another approver " +
        "edited them): check them again before you decide.");
    }
    const call = callsByKey.get(item.key);
    card.dataset.status = call ? call.status : "awaiting_approval";
    tickCard(card);
  }

  function tickCard(card) {
    const created = Number(card.dataset.created);
    card.querySelector(".requested").textContent =
      "requested " + clockTime.format(created) + " (" + ago(created) + ")";
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
        card.querySelectorAll("button").forEach((el) => { el.disabled = true; });
        showNote(card, "The deadline passed: this call is being rejected.");
      }
    } else {
      countdown.textContent = "expires in " + span(left);
      countdown.dataset.urgency = left < 60 ? "soon" : "ok";
    }
  }

  function showNote(card, text) {
    const note = card.querySelector(".note");
    note.textContent = visible(text);
    note.hidden = !text;
  }

  // What an ended call gave the model: its tool message's output (the result as JSON, or
  // the error), which the transcript holds.
  function outcomeText(key) {
    const message = toolOutputs.get(key);
    return message ? prettyText(message.tool_output) : "";
  }

  function renderDecided(item) {
    let card = decidedCards.get(item.interrupt_id);
    if (!card) {
      card = newCard("decided-card", item);
      decidedCards.set(item.interrupt_id, card);
    }
    const call = callsByKey.get(item.key);
    const message = toolOutputs.get(item.key);
    const status = call ? call.status : (message && message.call_status) || item.call_status;
    badge(card.querySelector(".decision"), "decision", item.decision);
    const statusEl = card.querySelector(".call-status");
    badge(statusEl, "status", status);
    // A rejected or expired call's status says the same as its decision badge.
    statusEl.hidden = status === "rejected" && item.decision !== "approved";
    card.dataset.status = status;
    card.dataset.decision = item.decision;
    const when = parseTime(item.decided_at);
    const who = item.decision === "expired"
      ? "expired at the deadline"
      : item.decision + " by " + (item.decided_by || "an unnamed token holder");
    const approvers = (item.approved_by || []).length > 1
      ? " (approvals: " + item.approved_by.join(", ") + ")" : "";
    setText(card, ".who", who + approvers + " · " + clockTime.format(when) + " (" +
      ago(when) + ")");
    const edited = card.querySelector(".edited");
    edited.hidden = !item.original_arguments;
    if (item.original_arguments) {
      edited.textContent = visible("approved with edited arguments; the model asked for " +
        JSON.stringify(item.original_arguments));
    }
    setDeadline(card, item.deadline ? parseTime(item.deadline) : null);
    const reason = card.querySelector(".reason");
    reason.textContent = visible(item.reason || "");
    reason.hidden = !item.reason;
    const outcome = card.querySelector(".outcome");
    // A rejected call's error repeats the reason shown above.
    const text = item.decision === "approved" ? outcomeText(item.key) : "";
    const failed = status !== "succeeded";
    outcome.textContent = text;
    outcome.hidden = !text;
    outcome.dataset.kind = failed ? "error" : "result";
    const outcomeLabel = card.querySelector(".outcome-label");
    outcomeLabel.textContent = failed ? "Error" : "Result";
    outcomeLabel.hidden = !text;
    return card;
  }

  // -- transcript --------------------------------------------------------------------------

  const ROLE_LABELS = { user: "User", assistant: "Assistant", tool: "Tool" };

  function newMessage() {
    return $("message").content.firstElementChild.cloneNode(true);
  }

  // One transcript entry. A tool message carries its call's name, status, key, arguments and
  // what the model reads (tool_output); a user message its text and queued/delivered status.
  function fillMessage(li, message) {
    const role = message.role || "user";
    li.dataset.role = role;
    setText(li, ".role", ROLE_LABELS[role] || role);
    clockTime.set(li.querySelector(".time"), parseTime(message.created_at));
    const status = role === "tool" ? message.call_status : message.status;
    badge(li.querySelector(".status"), "status", status);
    li.dataset.status = status || "";
    const isTool = role === "tool";
    show(li, ".tool", isTool);
    show(li, ".key", isTool && !!message.key);
    show(li, ".arguments", isTool && !!message.tool_arguments);
    show(li, ".output", isTool);
    show(li, ".output-label", isTool);
    show(li, ".text", !isTool && !!message.text);
    if (isTool) {
      li.dataset.key = message.key || "";
      setText(li, ".tool", message.tool || "");
      setText(li, ".key", message.key || "");
      setText(li, ".args", prettyText(message.tool_arguments));
      const output = li.querySelector(".output");
      output.textContent = prettyText(message.tool_output);
      output.dataset.kind = message.call_status === "succeeded" ? "result" : "error";
    } else {
      setText(li, ".text", message.text || "");
    }
  }

  // New messages go in by id (they come oldest first); ones already shown are updated (a
  // queued user message becomes delivered).
  function renderTranscript(messages, calls) {
    const list = $("transcript");
    for (const message of messages) {
      if (message.key) toolOutputs.set(message.key, message);
      let li = messageItems.get(message.id);
      if (!li) {
        li = newMessage();
        li.dataset.messageId = String(message.id);
        messageItems.set(message.id, li);
        let next = null;
        for (let el = list.lastElementChild; el; el = el.previousElementSibling) {
          if (Number(el.dataset.messageId) < message.id) break;
          next = el;
        }
        list.insertBefore(li, next);
      }
      fillMessage(li, message);
      lastMessageId = Math.max(lastMessageId, message.id);
    }
    // Calls not finished yet have no tool message: list them after the transcript.
    const flight = $("in-flight");
    flight.replaceChildren();
    for (const call of calls) {
      if (TERMINAL.has(call.status) || toolOutputs.has(call.key)) continue;
      const li = newMessage();
      li.classList.add("pending-call");
      fillMessage(li, {
        role: "tool", tool: call.tool, key: call.key, call_status: call.status,
        tool_arguments: JSON.stringify(call.arguments), created_at: call.created_at,
      });
      show(li, ".output", false);
      show(li, ".output-label", false);
      flight.appendChild(li);
    }
    $("transcript-count").textContent = String(messageItems.size);
    $("transcript-empty").hidden = messageItems.size > 0 || flight.children.length > 0;
  }

  // -- the whole page ----------------------------------------------------------------------

  function render(snapshot) {
    callsByKey = new Map(snapshot.tool_calls.map((c) => [c.key, c]));
    // Messages first: the decided cards show their call's outcome from its tool message.
    renderTranscript(snapshot.messages || [], snapshot.tool_calls);
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
      const card = renderDecided(item);
      if (list.children[index] !== card) list.insertBefore(card, list.children[index] || null);
    });
    $("pending-count").textContent = String(pendingCards.size);
    $("decided-count").textContent = String(decidedCards.size);
    $("pending-empty").hidden = pendingCards.size > 0;
    $("decided-empty").hidden = decidedCards.size > 0;
    document.body.dataset.loaded = "true";
  }

  async function refresh() {
    if (fatal) return;
    if (refreshing) { scheduleRefresh(); return; }  // coalesce with the one in flight
    refreshing = (async () => {
      try {
        const response = await api(base + "/snapshot?" + snapshotQuery());
        if (!response.ok) throw new Error("snapshot: HTTP " + response.status);
        const serverTime = Number(response.headers.get("X-Server-Time"));
        if (serverTime) serverOffsetMs = serverTime * 1000 - Date.now();
        const snapshot = await response.json();
        const first = eventCursor === null;
        if (first) eventCursor = snapshot.event_cursor;
        render(snapshot);
        // Beat's state as /healthz reads it: each read of the session says it again.
        $("beat-late").hidden = snapshot.beat !== "late";
        // The first read is the transcript's tail; later ones page forward until done.
        if (first) $("transcript-earlier").hidden = !snapshot.messages_more;
        else if (snapshot.messages_more) scheduleRefresh();
        if ($("banner").dataset.kind === "stale") banner("");
      } catch (err) {
        if (!fatal) banner("Could not load the session (" + err.message + "); retrying.", "stale");
      } finally {
        refreshing = null;
      }
    })();
    return refreshing;
  }

  // What to read: the newest messages first; then those after the last one shown, from
  // before the oldest still queued (its status changes when it is delivered).
  function snapshotQuery() {
    const query = new URLSearchParams({ limit: String(PAGE_LIMIT), open_calls: "true" });
    if (eventCursor === null) {
      query.set("messages_before", MAX_CURSOR);
      return query.toString();
    }
    let after = lastMessageId;
    for (const [id, li] of messageItems) {
      if (li.dataset.status === "queued") after = Math.min(after, id - 1);
    }
    query.set("messages_after", String(after));
    return query.toString();
  }

  function scheduleRefresh() {
    // Events come in bursts (queued, started, finished): one snapshot read per burst.
    if (refreshTimer) return;
    refreshTimer = setTimeout(() => { refreshTimer = null; refresh(); }, 150);
  }

  // -- decisions ---------------------------------------------------------------------------

  async function decide(card, approved) {
    const message = card.querySelector(".reject-message").value.trim();
    // Edit on approval: the edit box's JSON, sent only when it differs from the model's.
    let edited = null;
    const edit = card.querySelector(".edit-args");
    if (approved && edit && edit.dataset.touched) {
      try {
        edited = JSON.parse(edit.value);
      } catch (e) {
        showNote(card, "The edited arguments are not JSON: " + e.message);
        return;
      }
      if (card.querySelector(".args").textContent === pretty(edited)) edited = null;
    }
    card.dataset.busy = "true";
    card.querySelectorAll("button, input").forEach((el) => { el.disabled = true; });
    showNote(card, approved ? "Approving..." : "Rejecting...");
    try {
      const response = await api("/interrupts/resolve", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        // session_id is optional for a session token; an operator token needs it.
        body: JSON.stringify({
          interrupt_id: card.dataset.interruptId,
          approved: approved,
          rejection_message: approved || !message ? null : message,
          session_id: sessionId,
          arguments: edited,
          // The version this card shows: an approval of arguments someone changed since is
          // refused (409) rather than counted for a version this person did not see.
          arguments_version: approved && card.dataset.version ? card.dataset.version : null,
        }),
      });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error || body.detail || "HTTP " + response.status);
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
    const time = document.createElement("time");
    time.className = "time mono";
    const when = parseTime(data.created_at);
    time.textContent = when === null ? "" : new Date(when).toLocaleTimeString([], { hour12: false });
    const name = document.createElement("span");
    name.className = "event-name";
    name.dataset.event = event.type;
    name.textContent = event.type.replace(/_/g, " ");
    const key = document.createElement("span");
    key.className = "mono";
    key.textContent = visible(data.key + (data.to_status ? "  →  " + data.to_status : ""));
    li.append(time, name, key);
    li.dataset.cursor = event.lastEventId;
    const list = $("activity");
    list.prepend(li);
    while (list.children.length > ACTIVITY_LIMIT) list.lastElementChild.remove();
  }

  function connect() {
    // EventSource cannot send an Authorization header: the token goes in the query string.
    // From the first snapshot's cursor: what happened before is in the page already.
    events = new EventSource(base + "/events?token=" + encodeURIComponent(token)
                             + "&after=" + encodeURIComponent(String(eventCursor || 0)));
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
    events.addEventListener("token_expired", () => {
      events.close();
      fatal = true;
      banner("This link's token has expired. Ask for a new link.");
      live("closed", "signed out");
    });
  }

  if (!token) {
    banner("This page needs its link's ?token=... part. Ask for a new link.");
    live("closed", "signed out");
    return;
  }
  refresh().then(() => { if (!fatal) connect(); });
  setInterval(() => { for (const card of pendingCards.values()) tickCard(card); }, 1000);
})();
