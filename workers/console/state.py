"""What the console's handlers share: the connection, the guard, the templates, the live
overview (read once a second by :meth:`ConsoleState.sample`, whoever is watching), and the
notices an action leaves for the page it redirects to."""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from broker.connection import Connection
from broker.envelope import MESSAGE_ID_PATTERN

from ..overview import Overview, Readings, read_overview
from .history import History
from .security import Guard

NOTICES_KEPT = 200
_ID = re.compile(MESSAGE_ID_PATTERN)


def is_id(value: str) -> bool:
    return bool(_ID.match(value))


def templates() -> Jinja2Templates:
    loader = jinja2.PackageLoader("workers.console", "templates")
    return Jinja2Templates(env=jinja2.Environment(loader=loader, autoescape=True))


@dataclass
class ConsoleState:
    conn: Connection
    guard: Guard
    pages: Jinja2Templates = field(default_factory=templates)
    history: History = field(default_factory=History)
    readings: Readings = field(default_factory=Readings)
    stopping: anyio.Event = field(default_factory=anyio.Event)
    changed: anyio.Event = field(default_factory=anyio.Event)
    notices: OrderedDict[str, tuple[bool, list[str]]] = field(default_factory=OrderedDict)

    async def sample(self) -> Overview:
        """Read the overview now; wakes every live page."""
        view = self.readings.read(await read_overview(self.conn))
        self.history.add(view)
        self.changed.set()
        self.changed = anyio.Event()
        return view

    def lost(self) -> None:
        """Redis was away: no rate is counted across the outage, and the chart breaks."""
        self.readings.lost()
        self.history.lost()

    async def overview(self) -> Overview:
        latest = self.readings.last
        return latest if latest is not None else await self.sample()

    def leave_notice(self, ok: bool, lines: list[str]) -> str:
        key = secrets.token_urlsafe(9)
        self.notices[key] = (ok, lines)
        while len(self.notices) > NOTICES_KEPT:
            self.notices.popitem(last=False)
        return key

    def render(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        session = request.scope.get("console_session", "")
        notice = self.notices.get(request.query_params.get("notice", ""))
        return self.pages.TemplateResponse(
            request,
            name,
            {"csrf": self.guard.csrf(session), "notice": notice, "login": bool(self.guard.token)}
            | context,
            status_code=status_code,
        )
