// Clock times in the reader's own time zone, with its UTC offset spelt out, so a deadline
// reads the same to people in different places ("2025-06-01 14:03:05 UTC+02:00").
// The server renders <time class="clock" datetime="ISO"> in UTC; this rewrites them.
"use strict";

window.dexClock = (function () {
  function pad(n) { return String(n).padStart(2, "0"); }

  function offset(date) {
    const minutes = -date.getTimezoneOffset();
    const sign = minutes < 0 ? "-" : "+";
    const abs = Math.abs(minutes);
    return "UTC" + sign + pad(Math.floor(abs / 60)) + ":" + pad(abs % 60);
  }

  // Milliseconds since the epoch -> local date, time and offset.
  function format(ms) {
    if (ms === null || ms === undefined || Number.isNaN(ms)) return "";
    const d = new Date(ms);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + " " +
      offset(d);
  }

  // Fill a <time> element: visible local text, machine-readable ISO, UTC in the tooltip.
  function set(el, ms) {
    if (ms === null || ms === undefined || Number.isNaN(ms)) {
      el.textContent = "";
      el.removeAttribute("datetime");
      return;
    }
    const d = new Date(ms);
    el.dateTime = d.toISOString();
    el.textContent = format(ms);
    el.title = d.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  function localize(root) {
    for (const el of (root || document).querySelectorAll("time.clock[datetime]")) {
      const ms = Date.parse(el.getAttribute("datetime"));
      if (!Number.isNaN(ms)) set(el, ms);
    }
  }

  document.addEventListener("DOMContentLoaded", () => localize(document));
  return { format: format, set: set, localize: localize };
})();
