"""The HTML a person opens: the session page, the operator's sessions list, error pages.

Pages are rendered from files in this package with :class:`string.Template`; every value from
a token or the store goes in through :func:`html.escape`, and no page contains inline script
(the Content-Security-Policy forbids it). The session page's live parts (cards, transcript,
countdowns) are drawn by ``static/session.js`` from the snapshot and the event stream; what the
server renders is what must be there before any script runs: who you are working as.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from importlib import resources
from string import Template
from urllib.parse import quote

from dex_tasks.api.schemas import PendingSessions
from dex_tasks.tokens import VIEW, TokenClaims

# The pages load only our own scripts and stylesheet and talk only to this origin, so tool
# arguments rendered into them can never pull in or run anything else.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
}


def _template(name: str) -> Template:
    return Template(resources.files("dex_tasks.api").joinpath(name).read_text("utf-8"))


class Pages:
    """The page templates, read once when the app is built."""

    def __init__(self) -> None:
        self.session = _template("session.html")
        self.sessions = _template("sessions.html")

    def session_page(self, session_id: str, claims: TokenClaims, token: str) -> str:
        """The session page for the holder of ``claims``."""
        permission = claims.strongest_permission or VIEW
        can_operate = permission != VIEW
        inbox = ""
        if claims.all_sessions:
            inbox = (f' <a class="inbox-link" href="/sessions?token={_attr(quote(token))}">'
                     "All sessions waiting for a decision</a>")
        return self.session.substitute(
            session_id=_text(session_id),
            approver=_text(claims.approver or "an unnamed token holder"),
            permission=_text(permission),
            scope=' · <span class="scope">all sessions</span>' if claims.all_sessions else "",
            can_operate="true" if can_operate else "false",
            all_sessions="true" if claims.all_sessions else "false",
            expires_iso=_attr(_iso(claims.expires_at)),
            expires_utc=_text(_utc(claims.expires_at)),
            inbox_link=inbox,
            read_only_hidden="" if not can_operate else " hidden",
            unnamed_hidden="" if can_operate and claims.approver is None else " hidden",
        )

    def sessions_page(self, listing: PendingSessions, claims: TokenClaims, token: str) -> str:
        """The operator's list of sessions waiting for a decision, each linking to its page."""
        rows = []
        link_token = _attr(quote(token))
        for item in listing.sessions:
            deadline = ("no deadline" if item.next_deadline is None else
                        f'next deadline <time class="clock" '
                        f'datetime="{_attr(item.next_deadline.isoformat())}">'
                        f"{_text(_utc(item.next_deadline.timestamp()))}</time>")
            rows.append(
                f'<li class="session-row" data-session-id="{_attr(item.session_id)}">'
                f'<a class="mono" href="{_attr(item.page)}?token={link_token}">'
                f"{_text(item.session_id)}</a>"
                f'<span class="badge waiting">{item.pending} waiting</span>'
                f'<span class="meta">latest request <time class="clock" '
                f'datetime="{_attr(item.newest_request_at.isoformat())}">'
                f"{_text(_utc(item.newest_request_at.timestamp()))}</time> · {deadline}</span>"
                "</li>")
        more = (f"<p class=\"meta\">Only the {len(listing.sessions)} newest are shown.</p>"
                if listing.truncated else "")
        return self.sessions.substitute(
            approver=_text(claims.approver or "an unnamed token holder"),
            permission=_text(claims.strongest_permission or VIEW),
            expires_iso=_attr(_iso(claims.expires_at)),
            expires_utc=_text(_utc(claims.expires_at)),
            count=str(len(listing.sessions)),
            rows="\n".join(rows),
            empty_hidden=" hidden" if rows else "",
            truncated=more,
        )


def error_page(status_code: int, detail: str) -> str:
    """A 401/403 page for a person: what went wrong and how to get a working link."""
    title = "Not allowed" if status_code == 403 else "Sign-in link needed"
    return (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{title} - dex-tasks</title>"
        '<link rel="stylesheet" href="/static/dex.css">'
        f'<main class="error-page"><h1>{title}</h1><p>{_text(detail)}</p>'
        "<p>Ask an operator for a fresh link: <code>dex-tasks token SESSION_ID</code> prints "
        "a token (<code>--permission view</code> for a read-only one); open "
        "<code>/sessions/SESSION_ID?token=TOKEN</code>. The list of every session waiting for "
        "a decision needs an operator token: <code>dex-tasks token --all-sessions</code>, "
        "then <code>/sessions?token=TOKEN</code>.</p></main></html>"
    )


def _text(value: str) -> str:
    return html.escape(value, quote=False)


def _attr(value: str) -> str:
    return html.escape(value, quote=True)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def prefers_html(accept: str) -> bool:
    """Whether an ``Accept`` header ranks text/html above application/json (a browser's does;
    ``*/*``, curl's and httpx's default, does not)."""
    quality: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    return quality.get("text/html", 0.0) > quality.get("application/json", 0.0)
