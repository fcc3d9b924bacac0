"""The A2A front door: Agent-Reach as one A2A agent (``agent-reach a2a-gateway``, ``up --a2a``).

A Starlette app: the card at ``/.well-known/agent-card.json`` (every registered capability a
skill, refreshed as instances come and go), JSON-RPC at ``/`` (:mod:`workers.a2a_front` says
what each method reads and answers):

- ``SendMessage``: an envelope submitted; blocking (the default), the answer is the message's
  outcome as a task (COMPLETED with a ``result`` artifact, FAILED with the error, ...);
  ``returnImmediately``, a WORKING task whose id is the message id;
- ``GetTask``: the message's record, its stage as the task's state;
- ``CancelTask``: ``agent-reach cancel`` (queued messages; an A2A agent's task is asked to
  cancel); a message past cancelling is ``-32002``;
- ``SendStreamingMessage``: the stage changes as status updates, until the message ends;
- push notifications: the send's ``taskPushNotificationConfig`` is the message's
  ``callback_url`` (signed webhooks, the same allow-list); configs afterwards are ``-32004``.

Authentication: an API key in ``X-API-Key`` (declared in the card's ``securitySchemes``); the
gateway refuses to listen off loopback without one. Bodies over 1 MB are 413.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from adapters.asgi import serve_app
from adapters.callbacks import Answer, read_body
from broker.client import Client
from broker.config import answer_grace_s
from broker.connection import Connection
from broker.envelope import Envelope
from broker.errors import ReachError, RequestTimeout
from broker.jsondepth import depth_problem
from broker.operator import Operator
from broker.registry import Registry
from broker.stages import TERMINAL, Stage
from broker.store import MessageStore
from broker.webhooks import callback_problem

from .a2a_front import (
    API_KEY_HEADER,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    SERVER_BUSY,
    STATE_OF,
    TASK_NOT_CANCELABLE,
    TASK_NOT_FOUND,
    UNSUPPORTED,
    SendRequest,
    agent_card,
    is_request_id,
    request_problem,
    rpc_error,
    rpc_result,
    send_request,
    status_update,
    task_json,
)
from .console.security import Guard, cross_site
from .gateway_ids import gateway_secret, mint_task_id, minted_here
from .task_cancel import cancel_agent_task

log = logging.getLogger("agent_reach.a2a_gateway")
T = TypeVar("T")

MAX_BODY_BYTES = 1024 * 1024
CARD_FRESH_S = 2.0
STREAM_POLL_S = 0.05  # a stream's first looks at its task's timeline; then slower, to 1 s
STREAM_POLL_MAX_S = 1.0
MAX_STREAMS = 256  # open at once; past it a stream is refused (503), try again later
ACCEPT_WAIT_S = 10.0
# A client we do not run may hold a connection: its headers have 10 s, its body as long,
# and past this many connections at once the gateway answers 503.
HEADER_TIMEOUT_S = BODY_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024
# A refusal sent before the body is read closes the connection: kept open, the server would
# go on reading whatever body the refused client trickles in.
CLOSE = {"Connection": "close"}
# methods that answer with a stream: sent as a notification, there is no one to stream to
STREAMING = frozenset({"SendStreamingMessage"})
BLOCKING_TIMEOUT_S = 300.0  # a blocking send's deadline, when the client gives none

Handler = Callable[[Any, Any], Awaitable[dict[str, Any] | Response]]


class Gateway:
    def __init__(
        self, conn: Connection, client: Client, *, url: str, api_key: str | None, secret: bytes
    ) -> None:
        self.conn = conn
        self.secret = secret  # its task ids' (workers.gateway_ids)
        self.client = client
        self.store = MessageStore(conn)
        self.url = url
        self.api_key = api_key
        self.body_timeout_s = BODY_TIMEOUT_S
        self.task_timeout_s = BLOCKING_TIMEOUT_S  # a task's deadline (tests shorten it)
        self.streams = 0  # open now
        self.max_streams = MAX_STREAMS
        self._card: tuple[float, dict[str, Any]] | None = None
        self._methods: dict[str, Handler] = {
            "SendMessage": self.send,
            "GetTask": self.get_task,
            "CancelTask": self.cancel_task,
            "SendStreamingMessage": self.send_streaming,
            "CreateTaskPushNotificationConfig": self.push_config,
        }

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/.well-known/agent-card.json", self.card, methods=["GET"]),
                Route("/", self.rpc, methods=["POST"]),
            ]
        )

    async def card(self, request: Request) -> Response:
        now = anyio.current_time()
        if self._card is None or now - self._card[0] > CARD_FRESH_S:
            capabilities = {
                c for v in await Registry(self.conn).snapshot() for c in v.card.capabilities
            }
            self._card = (now, agent_card(self.url, capabilities, api_key=bool(self.api_key)))
        return JSONResponse(self._card[1])

    async def rpc(self, request: Request) -> Response:
        if self.api_key and not hmac.compare_digest(
            request.headers.get(API_KEY_HEADER, "").encode(), self.api_key.encode()
        ):
            error = {"error": f"missing or wrong {API_KEY_HEADER}"}
            return JSONResponse(error, status_code=401, headers=CLOSE)
        refused = self._browser_refusal(request)
        if refused is not None:
            return JSONResponse({"error": refused}, status_code=403, headers=CLOSE)
        body: bytes | Answer = Answer(408, {"error": "the body did not arrive in time"})
        with anyio.move_on_after(self.body_timeout_s):
            body = await read_body(request, MAX_BODY_BYTES)
        if isinstance(body, Answer):  # a 413 keeps it: a client still sending would see a reset
            close = CLOSE if body.status != 413 else None
            return JSONResponse(body.body, status_code=body.status, headers=close)
        try:
            call = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return JSONResponse(rpc_error(None, PARSE_ERROR, "the body is not JSON"))
        if problem := request_problem(call):
            request_id = call.get("id") if isinstance(call, dict) else None
            return JSONResponse(
                rpc_error(request_id if is_request_id(request_id) else None, *problem)
            )
        return await self._answer(request, call)

    async def _answer(self, request: Request, call: dict[str, Any]) -> Response:
        """Run a valid request object's method; a notification (no ``id``) is run and never
        answered (JSON-RPC 2.0, section 4.1) but for a stream, which no one would read. Only
        a send's wait for its outcome ends when the client hangs up: what changes state (a
        cancel, a submit) runs to its end, its client there or not."""
        request_id, method = call.get("id"), call["method"]
        handler = self._methods.get(method)
        if "id" not in call:
            with contextlib.suppress(ReachError):
                if method == "SendMessage":
                    await self.notified_send(call.get("params"))
                elif handler is not None and method not in STREAMING:
                    await handler(None, call.get("params"))
            return Response(status_code=204)
        if handler is None:
            return JSONResponse(rpc_error(request_id, METHOD_NOT_FOUND, f"no method {method!r}"))
        params = call.get("params")
        try:
            if method == "SendMessage":
                answer = await until_gone(request, lambda: handler(request_id, params))
            else:
                answer = await handler(request_id, params)
        except ReachError as exc:  # an envelope refused, Redis unavailable: said as it is
            answer = rpc_error(request_id, INVALID_PARAMS, str(exc))
        if answer is None:
            log.info("the client went away: %s %r no longer answered", method, request_id)
            return Response(status_code=499)  # no one reads it
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    def _browser_refusal(self, request: Request) -> str | None:
        """Why a request that a web page could have sent is refused, without an API key to
        prove otherwise: a JSON body only (a form or text/plain needs no preflight), from no
        other site, to a loopback name (against DNS rebinding)."""
        if self.api_key:
            return None
        headers = request.headers
        if not headers.get("content-type", "").startswith("application/json"):
            return "send the request as application/json"
        host = headers.get("host", "")
        if cross_site(headers.get("origin"), headers.get("sec-fetch-site"), host):
            return "a request from another site is refused"
        if not Guard(None).host_allowed(host):
            return "without an API key only a loopback name is served"
        return None

    # -- methods -------------------------------------------------------------------------------

    def _asked(self, params: Any) -> SendRequest | str:
        """What a send asks for, or why the dispatcher would refuse it: said now, in every
        mode, rather than as a task that is WORKING and then REJECTED."""
        asked = send_request(params)
        if isinstance(asked, str):
            return asked
        settings = self.conn.settings
        url = asked.callback_url
        if url and (
            problem := callback_problem(url, settings.callback_hosts, settings.webhook_secret)
        ):
            return f"configuration.taskPushNotificationConfig.url: {problem}"
        if problem := depth_problem(msgspec.json.encode(asked.payload)):
            return f"the message's data: {problem}"
        return asked

    async def send(self, request_id: Any, params: Any) -> dict[str, Any]:
        asked = self._asked(params)
        if isinstance(asked, str):
            return rpc_error(request_id, INVALID_PARAMS, asked)
        if not asked.blocking:
            message_id = await self._submit(asked)
            await self._accepted(message_id)
            return rpc_result(request_id, {"task": task_json(message_id, Stage.PROCESSING)})
        try:
            result = await self.client.request(
                asked.capability,
                asked.payload,
                timeout=self.task_timeout_s,
                id=mint_task_id(self.secret),
                **asked.fields,
            )
        except RequestTimeout as exc:
            return await self.get_task(request_id, {"id": exc.message_id})
        task = task_json(result.id, result.stage, result=result.result, error=result.error)
        return rpc_result(request_id, {"task": task})

    async def notified_send(self, params: Any) -> None:
        """A send as a notification: submitted if it may be, nothing awaited (no one reads
        its outcome, nor whether the dispatcher has its record yet)."""
        asked = self._asked(params)
        if not isinstance(asked, str):
            await self._submit(asked)

    async def _submit(self, asked: SendRequest) -> str:
        envelope = Envelope(
            id=mint_task_id(self.secret),
            capability=asked.capability,
            payload=msgspec.Raw(msgspec.json.encode(asked.payload)),
            timeout_s=self.task_timeout_s,
            **asked.fields,
        )
        with anyio.CancelScope(shield=True):  # a hang-up ends the wait after it, not the write
            message_id = await self.client.submit(envelope)
        return message_id

    async def _accepted(self, message_id: str) -> None:
        """Until the dispatcher has made the message's record (so that ``GetTask`` and
        ``CancelTask`` find it), for at most :data:`ACCEPT_WAIT_S`."""
        with anyio.move_on_after(ACCEPT_WAIT_S):
            while await self.store.get_record(message_id) is None:  # noqa: ASYNC110 - polled
                await anyio.sleep(STREAM_POLL_S)

    async def get_task(self, request_id: Any, params: Any) -> dict[str, Any]:
        task = await self._task(params)
        if task is None:
            return rpc_error(request_id, TASK_NOT_FOUND, "Task not found")
        return rpc_result(request_id, task)

    async def _task(self, params: Any) -> dict[str, Any] | None:
        task_id = params.get("id") if isinstance(params, dict) else None
        if not isinstance(task_id, str) or not minted_here(self.secret, task_id):
            return None  # not one of the gateway's: a producer's message is not a task here
        record = await self.store.get_record(task_id)
        if record is None:
            return None
        result = msgspec.json.decode(record.result) if record.result is not None else None
        return task_json(record.id, record.stage, result=result, error=record.error)

    async def cancel_task(self, request_id: Any, params: Any) -> dict[str, Any]:
        task = await self._task(params)
        if task is None:
            return rpc_error(request_id, TASK_NOT_FOUND, "Task not found")
        by = "a2a-gateway"
        asked = await cancel_agent_task(self.conn, task["id"], by=by)
        action = asked or await Operator(self.conn).cancel(task["id"], by=by)
        if not action.done:
            return rpc_error(request_id, TASK_NOT_CANCELABLE, action.detail)
        return rpc_result(request_id, await self._task(params))

    async def push_config(self, request_id: Any, params: Any) -> dict[str, Any]:
        why = (
            "give the push config with the send (configuration.taskPushNotificationConfig): "
            "it becomes the message's callback_url"
        )
        return rpc_error(request_id, UNSUPPORTED, why)

    async def send_streaming(self, request_id: Any, params: Any) -> dict[str, Any] | Response:
        asked = self._asked(params)
        if isinstance(asked, str):
            return rpc_error(request_id, INVALID_PARAMS, asked)
        if self.streams >= self.max_streams:  # each one looks at Redis until its task ends
            busy = rpc_error(request_id, SERVER_BUSY, f"{self.streams} streams are open: later")
            return JSONResponse(busy, status_code=503, headers={"Retry-After": "1"})
        self.streams += 1  # taken before any await: requests at once see each other's
        try:
            message_id = await self._submit(asked)
        except BaseException:
            self.streams -= 1
            raise
        return _Stream(self._updates(request_id, message_id), self._stream_ended)

    def _stream_ended(self) -> None:
        self.streams -= 1

    async def _updates(self, request_id: Any, message_id: str) -> AsyncIterator[bytes]:
        """The task, then a status update for each state its timeline passes through (every
        stage is on the timeline, however fast it moved), the result, and the end."""
        yield _event(request_id, {"task": task_json(message_id, Stage.ACCEPTED)})
        seen, said, pause = 0, STATE_OF[Stage.ACCEPTED], STREAM_POLL_S
        # the task's deadline and the reaper's grace past it: its EXPIRED ends the stream
        with anyio.move_on_after(self.task_timeout_s + answer_grace_s(self.conn.settings)):
            while True:
                timeline = await self.store.get_timeline(message_id)
                # looked at again soon while it moves, and less often while it waits
                pause = STREAM_POLL_S if len(timeline) > seen else min(2 * pause, STREAM_POLL_MAX_S)
                for entry in timeline[seen:]:
                    stage = entry.stage
                    if not isinstance(stage, Stage) or STATE_OF[stage] == said:
                        continue
                    said = STATE_OF[stage]
                    if stage in TERMINAL:
                        async for event in self._ending(request_id, message_id):
                            yield event
                        return
                    yield _event(request_id, status_update(message_id, stage))
                seen = len(timeline)
                await anyio.sleep(pause)

    async def _ending(self, request_id: Any, message_id: str) -> AsyncIterator[bytes]:
        record = await self.store.get_record(message_id)
        if record is None:
            return
        result = msgspec.json.decode(record.result) if record.result is not None else None
        task = task_json(message_id, record.stage, result=result, error=record.error)
        for artifact in task.get("artifacts", []):
            update = {"taskId": message_id, "contextId": message_id, "artifact": artifact}
            yield _event(request_id, {"artifactUpdate": update})
        yield _event(request_id, status_update(message_id, record.stage, record.error))


class _Stream(StreamingResponse):
    """An event stream that gives its place back when it is over, however it ends (its
    task's end, the client gone, or never begun)."""

    def __init__(self, events: AsyncIterator[bytes], ended: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended()


async def until_gone(request: Request, call: Callable[[], Awaitable[T]]) -> T | None:
    """``call()``'s answer, or ``None`` once the client has gone away: a blocking send whose
    caller hung up stops waiting for an outcome no one will read (the message itself goes
    on; ``GetTask`` finds it)."""
    answered: list[T] = []
    failed: list[Exception] = []

    async def answer(scope: anyio.CancelScope) -> None:
        try:
            answered.append(await call())
        except Exception as exc:  # raised as itself below, not in a group
            failed.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer, tg.cancel_scope)
        # the body is read: the next message a server sends the app is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return answered[0] if answered else None


def _event(request_id: Any, result: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(rpc_result(request_id, result)) + b"\n\n"


@asynccontextmanager
async def gateway_endpoint(
    conn: Connection,
    host: str,
    port: int,
    api_key: str | None,
    public_url: str | None = None,
    *,
    body_timeout_s: float = BODY_TIMEOUT_S,
    task_timeout_s: float = BLOCKING_TIMEOUT_S,
    max_streams: int = MAX_STREAMS,
) -> AsyncIterator[str]:
    """Serve the gateway for the block's life; yields the URL it announces in its card."""
    async with Client(conn) as client:
        secret = await gateway_secret(conn)
        gateway = Gateway(conn, client, url="", api_key=api_key, secret=secret)
        gateway.body_timeout_s, gateway.max_streams = body_timeout_s, max_streams
        gateway.task_timeout_s = task_timeout_s
        async with serve_app(
            gateway.app(),
            host,
            port,
            header_timeout_s=HEADER_TIMEOUT_S,
            max_connections=MAX_CONNECTIONS,
        ) as url:
            gateway.url = (public_url or url).rstrip("/") + "/"
            yield gateway.url
