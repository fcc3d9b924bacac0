"""The console's pages (GET) and their live parts, streamed as server-sent events.

Each page has one live region (``id="live"``): the page renders it once, and
``/events/<page>`` sends it again, rendered the same way, whenever it changes — at most once
a second, after each reading of the overview. The page's script swaps it in, unless the
operator is typing in it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from broker.client import Client
from broker.errors import UnknownMessage
from broker.operator import Operator
from broker.stages import IN_FLIGHT, PARKED, QUEUED, Stage
from broker.timekeeping import now_ms
from broker.usage import DIMENSIONS
from broker.usage_reader import usage_totals
from broker.wire import route_steps

from ..overview import broadcast_children
from .state import ConsoleState, is_id

Fragment = Callable[[], Awaitable[str]]
STUCK_STAGES = sorted(s.value for s in IN_FLIGHT | QUEUED | PARKED)
SHOWN_BYTES = 64 * 1024
KEEPALIVE_S = 15.0


def state_of(request: Request) -> ConsoleState:
    state: ConsoleState = request.app.state.console
    return state


def _fragment(state: ConsoleState, request: Request, name: str, **context: Any) -> str:
    session = request.scope.get("console_session", "")
    template = state.pages.env.get_template(name)
    return template.render(csrf=state.guard.csrf(session), **context)


# -- overview and agents ---------------------------------------------------------------------


async def overview_context(state: ConsoleState) -> dict[str, Any]:
    return {"view": await state.overview(), "chart": state.history.chart()}


async def overview(request: Request) -> Response:
    state = state_of(request)
    return state.render(request, "overview.html", page="overview", **await overview_context(state))


async def agents(request: Request) -> Response:
    state = state_of(request)
    return state.render(request, "agents.html", page="agents", view=await state.overview())


# -- messages --------------------------------------------------------------------------------


def _float(raw: str | None, default: float) -> float:
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if 0 <= value < 10**9 else default


async def messages(request: Request) -> Response:
    state = state_of(request)
    query = request.query_params
    wanted = query.get("id", "").strip()
    if wanted:
        if is_id(wanted) and await state.conn.call("EXISTS", state.conn.keys.record(wanted)):
            return RedirectResponse(f"/messages/{wanted}", status_code=303)
        return state.render(request, "messages.html", 404, page="messages", **_no_message(wanted))
    stage = query.get("stage", "")
    capability = query.get("capability", "").strip()
    older_than_s = _float(query.get("older_than"), 30.0)
    found = await Operator(state.conn).stuck(
        older_than_s=older_than_s, stage=Stage(stage) if stage in STUCK_STAGES else None
    )
    if capability:
        found = [m for m in found if m.capability == capability]
    return state.render(
        request,
        "messages.html",
        page="messages",
        stuck=found[:500],
        more=max(0, len(found) - 500),
        stages=STUCK_STAGES,
        filters={"stage": stage, "capability": capability, "older_than": older_than_s},
    )


def _no_message(wanted: str) -> dict[str, Any]:
    return {"missing": wanted[:200], "stuck": [], "more": 0, "stages": STUCK_STAGES, "filters": {}}


def shown(raw: bytes | None) -> str | None:
    """JSON bytes as indented text, cut for the page."""
    if raw is None:
        return None
    try:
        text = json.dumps(msgspec.json.decode(raw[:SHOWN_BYTES]), indent=2)
    except (msgspec.DecodeError, RecursionError):
        text = raw[:SHOWN_BYTES].decode("utf-8", "replace")
    return text if len(raw) <= SHOWN_BYTES else text + f"\n… ({len(raw)} bytes in all)"


async def message_context(state: ConsoleState, message_id: str) -> dict[str, Any]:
    found = await Client(state.conn).trace(message_id)
    record = found.record
    shown_entries = state.conn.settings.timeline_max  # what a record keeps, written as it is
    return {
        "record": record,
        "timeline": found.timeline[-shown_entries:],
        "timeline_more": max(0, len(found.timeline) - shown_entries),
        "funnel": route_steps(record.route_from),
        "children": await broadcast_children(state.conn, message_id),
        "result": shown(record.result),
        "payload": shown(_payload(record.envelope)),
    }


def _payload(envelope: bytes) -> bytes | None:
    try:
        raw = msgspec.json.decode(envelope, type=dict[str, msgspec.Raw]).get("payload")
    except msgspec.DecodeError:
        return None
    return bytes(raw) if raw is not None else None


async def message(request: Request) -> Response:
    state = state_of(request)
    message_id = request.path_params["message_id"]
    try:
        if not is_id(message_id):
            raise UnknownMessage(message_id[:200])
        context = await message_context(state, message_id)
    except UnknownMessage:
        return state.render(
            request, "messages.html", 404, page="messages", **_no_message(message_id)
        )
    return state.render(request, "message.html", page="messages", **context)


# -- dead letters ----------------------------------------------------------------------------


async def dlq_context(state: ConsoleState, reason: str, count: int = 200) -> dict[str, Any]:
    letters = await Operator(state.conn).dead_letters(count)
    shown_letters = [
        each for each in reversed(letters.letters) if not reason or each.reason == reason
    ]
    return {
        "total": letters.total,
        "letters": shown_letters,
        # what the filter can ask for: a reason is matched whole, and asked for in 200 characters
        "reasons": sorted({each.reason for each in letters.letters if len(each.reason) <= 200}),
        "reason": reason,
    }


async def dlq(request: Request) -> Response:
    state = state_of(request)
    reason = request.query_params.get("reason", "")[:200]
    return state.render(request, "dlq.html", page="dlq", **await dlq_context(state, reason))


# -- usage -----------------------------------------------------------------------------------

USAGE_SPANS = {"1d": 1, "7d": 7, "30d": 30}


async def usage(request: Request) -> Response:
    """What ``agent-reach usage`` shows: requests, outcomes, busy time, tokens and cost, by
    agent, capability or tenant, over today or the last 7 or 30 UTC days."""
    state = state_of(request)
    by = request.query_params.get("by", "agent")
    by = by if by in DIMENSIONS else "agent"
    since = request.query_params.get("since", "1d")
    since = since if since in USAGE_SPANS else "1d"
    rows = await usage_totals(state.conn, by, USAGE_SPANS[since], now_ms())
    return state.render(
        request,
        "usage.html",
        page="usage",
        rows=rows,
        by=by,
        since=since,
        dimensions=DIMENSIONS,
        spans=list(USAGE_SPANS),
        retried=sum(int(row.figures["retried"]) for row in rows),
    )


# -- live regions ----------------------------------------------------------------------------


async def events(request: Request) -> Response:
    """``/events/<page>``: the page's live region, each time it changes."""
    state = state_of(request)
    page = request.path_params["page"]
    fragments: dict[str, Fragment] = {
        "overview": lambda: _overview_fragment(state, request),
        "agents": lambda: _agents_fragment(state, request),
        "dlq": lambda: _dlq_fragment(state, request),
    }
    message_id = request.query_params.get("id", "")
    if page == "message" and is_id(message_id):
        fragments["message"] = lambda: _message_fragment(state, request, message_id)
    if page not in fragments:
        return Response("no such live page", status_code=404, media_type="text/plain")
    return StreamingResponse(
        _stream(state, fragments[page]),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _stream(state: ConsoleState, fragment: Fragment) -> AsyncIterator[str]:
    last = None
    quiet_s = 0.0
    while not state.stopping.is_set():
        html = await fragment()
        if html != last:
            yield f"event: fragment\ndata: {json.dumps({'id': 'live', 'html': html})}\n\n"
            last, quiet_s = html, 0.0
        elif quiet_s >= KEEPALIVE_S:
            yield ": still here\n\n"
            quiet_s = 0.0
        before = anyio.current_time()
        with anyio.move_on_after(2.0):
            await state.changed.wait()
        quiet_s += anyio.current_time() - before


async def _overview_fragment(state: ConsoleState, request: Request) -> str:
    return _fragment(state, request, "_overview.html", **await overview_context(state))


async def _agents_fragment(state: ConsoleState, request: Request) -> str:
    return _fragment(state, request, "_agents.html", view=await state.overview())


async def _dlq_fragment(state: ConsoleState, request: Request) -> str:
    reason = request.query_params.get("reason", "")[:200]
    return _fragment(state, request, "_dlq.html", **await dlq_context(state, reason))


async def _message_fragment(state: ConsoleState, request: Request, message_id: str) -> str:
    try:
        context = await message_context(state, message_id)
    except UnknownMessage:
        return "<p>This message's record has expired.</p>"
    return _fragment(state, request, "_message.html", **context)
