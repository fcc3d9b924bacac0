"""``agent-reach console``: the web console — a Starlette app, pages rendered on the server,
their live parts streamed as server-sent events (:mod:`workers.console.pages`), actions as
POSTs (:mod:`workers.console.actions`), who may do what in :mod:`workers.console.security`.
It also serves ``/metrics``, the same page as ``up --metrics-port``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adapters.asgi import serve_app
from broker.connection import Connection
from broker.errors import RedisReplyError, RedisUnavailable

from ..metrics_page import CONTENT_TYPE, render
from . import actions, pages
from .security import COOKIE, Guard, cross_site
from .state import ConsoleState

log = logging.getLogger("agent_reach.console")
SAMPLE_EVERY_S = 1.0
MAX_FORM_BYTES = 1 << 20
OPEN = frozenset({"/login", "/static"})  # reached without a session


class Gate:
    """Every request: a host we answer for, a session (else the login page, or 401), and for
    a POST a same-site request with the page's CSRF token (else 403)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        refusal = await self._refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if request.method != "POST":
            await self.app(scope, receive, send)
            return
        body = await request.body()  # read already, for the CSRF token: handed on again
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refusal(self, request: Request) -> Response | None:
        host = request.headers.get("host", "")
        if not self.guard.host_allowed(host):
            return PlainTextResponse("this console answers on its loopback address", 400)
        session = self.guard.session(
            request.headers.get("authorization"), request.cookies.get(COOKIE)
        )
        first = "/" + request.url.path.lstrip("/").split("/", 1)[0]
        if session is None and first not in OPEN:
            if request.method == "GET" and first not in ("/events", "/metrics"):
                return RedirectResponse("/login", status_code=303)
            return PlainTextResponse("not authorised: log in, or send the token", 401)
        request.scope["console_session"] = session or ""
        if request.method == "POST":
            if int(request.headers.get("content-length") or 0) > MAX_FORM_BYTES:
                return PlainTextResponse("refused: a form of at most 1 MB", 413)
            if cross_site(
                request.headers.get("origin"), request.headers.get("sec-fetch-site"), host
            ):
                return PlainTextResponse("refused: a request from another site", 403)
            await request.body()  # kept: the form is parsed from it, and handed on below
            form = await request.form()
            if not self.guard.csrf_ok(session or "", str(form.get("csrf", ""))):
                return PlainTextResponse("refused: the form's CSRF token is missing or wrong", 403)
        return None


async def login_page(request: Request) -> Response:
    state = pages.state_of(request)
    return state.render(request, "login.html", page="", failed=False)


async def login(request: Request) -> Response:
    state = pages.state_of(request)
    form = await request.form()
    value = state.guard.login(str(form.get("token", "")))
    if value is None:
        return state.render(request, "login.html", 401, page="", failed=True)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, value, httponly=True, samesite="strict")
    return response


async def metrics(request: Request) -> Response:
    return Response(await render(pages.state_of(request).conn), media_type=CONTENT_TYPE)


async def redis_trouble(request: Request, exc: Exception) -> Response:
    log.warning("console: %s %s: %s", request.method, request.url.path, exc)
    if isinstance(exc, RedisUnavailable):
        return PlainTextResponse(f"Redis is unavailable ({exc}); try again when it is back", 503)
    return PlainTextResponse(f"Redis answered with an error: {exc}", 503)


def console_app(conn: Connection, guard: Guard) -> Starlette:
    static = Path(str(files("workers.console") / "static"))
    routes = [
        Route("/", pages.overview),
        Route("/agents", pages.agents),
        Route("/agents/{instance}/weight", actions.set_weight, methods=["POST"]),
        Route("/agents/{instance}/drain", actions.drain, methods=["POST"]),
        Route("/messages", pages.messages),
        Route("/messages/{message_id}", pages.message),
        Route("/messages/{message_id}/replay", actions.replay_message, methods=["POST"]),
        Route("/messages/{message_id}/resolve", actions.resolve_message, methods=["POST"]),
        Route("/messages/{message_id}/cancel", actions.cancel_message, methods=["POST"]),
        Route("/dlq", pages.dlq),
        Route("/usage", pages.usage),
        Route("/dlq/replay", actions.replay_letters, methods=["POST"]),
        Route("/events/{page}", pages.events),
        Route("/login", login_page),
        Route("/login", login, methods=["POST"]),
        Route("/metrics", metrics),
        Mount("/static", StaticFiles(directory=static), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Gate, guard=guard)],
        exception_handlers={
            RedisReplyError: redis_trouble,
            RedisUnavailable: redis_trouble,
            OSError: redis_trouble,
        },
    )
    app.state.console = ConsoleState(conn, guard)
    return app


async def sample_forever(state: ConsoleState) -> None:
    """Read the overview every second, for the chart and every live page. Redis away, or a
    reading that fails, is a gap in the chart, never the end of the console (nor of the
    roles served beside it)."""
    while True:
        try:
            await state.sample()
        except (RedisUnavailable, RedisReplyError, OSError) as exc:
            log.warning("console: reading the overview: %s", exc)
            state.lost()
        except Exception:  # a defect, or stored data no reader expects: a gap, not the end
            log.exception("console: reading the overview failed")
            state.lost()
        await anyio.sleep(SAMPLE_EVERY_S)


@asynccontextmanager
async def console_endpoint(
    conn: Connection, host: str, port: int, token: str | None
) -> AsyncIterator[str]:
    """Serve the console while the block runs; yields its URL."""
    app = console_app(conn, Guard(token))
    state: ConsoleState = app.state.console
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_forever, state)
        try:
            async with serve_app(app, host, port, header_timeout_s=10.0) as url:
                try:
                    yield url
                finally:
                    state.stopping.set()  # live pages end their streams
        finally:
            tg.cancel_scope.cancel()
