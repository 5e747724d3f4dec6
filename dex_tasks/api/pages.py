"""The HTML a person opens: the session page, the operator's sessions list, error pages.

Pages are Jinja2 templates in ``dex_tasks/api/templates`` (one ``base.html`` holds the head
every page shares), rendered with autoescaping on, so every value from a token or the store is
escaped; no page contains inline script (the Content-Security-Policy forbids it). The session
page's live parts (cards, transcript, countdowns) are drawn by ``static/session.js`` from the
snapshot and the event stream; what the server renders is what must be there before any script
runs: who you are working as, and whether beat is late.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

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


def _moment(value: float | datetime) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromtimestamp(value, tz=UTC)


def _iso(value: float | datetime) -> str:
    return _moment(value).isoformat(timespec="seconds")


def _utc(value: float | datetime) -> str:
    return _moment(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def page_templates() -> Jinja2Templates:
    """The pages' templates, autoescaped (every template is HTML), strict about undefined
    names so a misspelt one fails the tests instead of rendering empty."""
    env = Environment(loader=PackageLoader("dex_tasks.api", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      undefined=StrictUndefined, trim_blocks=False)
    env.filters["iso"] = _iso
    env.filters["utc"] = _utc
    return Jinja2Templates(env=env)


class Pages:
    """The page templates, loaded once when the app is built."""

    def __init__(self) -> None:
        self.templates = page_templates()

    def _render(self, request: Request, name: str, context: dict[str, Any],
                status_code: int = 200, headers: Mapping[str, str] | None = None) -> HTMLResponse:
        return self.templates.TemplateResponse(
            request, name, context, status_code=status_code,
            headers={**PAGE_HEADERS, **(headers or {})})

    def session_page(self, request: Request, session_id: str, claims: TokenClaims, token: str,
                     *, beat_late: bool = False) -> HTMLResponse:
        """The session page for the holder of ``claims``; ``beat_late`` shows the warning that
        deadlines are not being enforced."""
        permission = claims.strongest_permission or VIEW
        return self._render(request, "session.html", {
            "session_id": session_id, "claims": claims, "approver": claims.approver,
            "permission": permission, "can_operate": permission != VIEW,
            "expires_at": claims.expires_at, "beat_late": beat_late,
            "inbox_url": f"/sessions?token={quote(token)}" if claims.all_sessions else None,
        })

    def sessions_page(self, request: Request, listing: PendingSessions, claims: TokenClaims,
                      token: str) -> HTMLResponse:
        """The operator's list of sessions waiting for a decision, each linking to its page."""
        return self._render(request, "sessions.html", {
            "listing": listing, "claims": claims, "approver": claims.approver,
            "permission": claims.strongest_permission or VIEW, "token": token,
            "expires_at": claims.expires_at,
        })

    def error_page(self, request: Request, status_code: int, detail: str,
                   headers: Mapping[str, str]) -> HTMLResponse:
        """A 401/403 page for a person: what went wrong and how to get a working link."""
        title = "Not allowed" if status_code == 403 else "Sign-in link needed"
        return self._render(request, "error.html", {"title": title, "detail": detail},
                            status_code=status_code, headers=headers)


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
