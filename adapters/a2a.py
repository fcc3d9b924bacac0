"""The ``a2a`` adapter: reach an agent that speaks the Agent2Agent protocol, as it is.

At start the sidecar reads the agent's card (:func:`fetch_card`); its skills become
capabilities through ``--skill SKILL_ID=domain.action`` (or ``--capability`` for all), its
name, version and description go on our card. A card that cannot be read stops start-up
with the reason.

Each attempt is one ``SendMessage`` (JSON-RPC, in the card's protocol version, see
:mod:`adapters.a2a_wire`), non-blocking: the payload as a data part (a text part for a JSON
string), ``messageId`` ``<message id>.<attempt>`` (the same on a retry of the same attempt),
our idempotency key, attempt and trace context in the message's metadata and in the headers.
What comes back:

- a COMPLETED task, or a direct message: SUCCEEDED, the artifacts / parts as the result;
- FAILED / REJECTED / CANCELED: FAILED with the agent's status message; a JSON-RPC error:
  FAILED with its code and message;
- INPUT_REQUIRED / AUTH_REQUIRED: parked for an operator with the agent's question;
- SUBMITTED / WORKING: accepted (the task id goes on the record). When the card offers push
  notifications, the push config names the sidecar's endpoint (``/a2a/<message id>``) and
  our callback token; otherwise the sidecar asks ``GetTask`` (:meth:`A2ATransport.task`) at
  every sweep, with back-off, until the task ends. Either way the ending is recorded as a
  callback's is (CALLBACK_RECEIVED, then SUCCEEDED / FAILED).
- transport errors as for ``http``: not connected is not reached, no answer is ambiguous,
  429 / 503 with ``Retry-After`` is back-pressure.

The reaper asks ``GetTask`` too (:func:`a2a_status`): the card's status URL is
``a2a:<version>:<JSON-RPC URL>``.

Written on ``httpx`` rather than the ``a2a-sdk`` client: the sidecar must tell "never sent"
from "sent, no answer" (only the second is ambiguous), which the SDK's errors do not, and the
JSON-RPC binding is a few requests whose shapes :mod:`adapters.a2a_wire` keeps as data.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx

from broker.envelope import Envelope

from .a2a_rpc import STATUS_SCHEME, http_outcome, json_rpc
from .a2a_stream import StreamReading, Update, consume, stream_outcome
from .a2a_wire import (
    CARD_PATH,
    DIALECTS,
    AgentCardView,
    RpcError,
    TaskView,
    outcome_of,
    parse_card,
    rpc,
    rpc_answer,
    send_params,
    sent_task,
    task_view,
)
from .callbacks import CallbackTokens
from .http import NOT_SENT, AgentAnswer, SendWatch, agent_limits, exchange, read_limited
from .outcome import Accepted, Ambiguous, Failed, NotReached, Outcome
from .transport import reach_headers

A2A_PATH = "/a2a/"  # the sidecar's push-notification endpoint: <base>/a2a/<message id>
CARD_LIMIT_BYTES = 1024 * 1024
# a call's streamed status updates noted on the timeline; past them, one note says so
MAX_NOTED_UPDATES = 100


class CardError(Exception):
    """The agent's card cannot be read or used: start-up stops with this reason."""


async def fetch_card(url: str, *, timeout_s: float = 10.0) -> AgentCardView:
    """The card at ``url`` (the agent's base URL, or the card's own URL)."""
    card_url = url if url.endswith(".json") else url.rstrip("/") + CARD_PATH
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            request = client.build_request("GET", card_url)
            response, body = await exchange(client, request, CARD_LIMIT_BYTES)
    except httpx.HTTPError as exc:
        raise CardError(f"cannot read the agent card at {card_url}: {exc!r}") from exc
    if response.status_code != 200:
        raise CardError(f"the agent card at {card_url}: HTTP {response.status_code}")
    if body is None:
        raise CardError(f"the agent card at {card_url} is over {CARD_LIMIT_BYTES} bytes")
    card = parse_card(body)
    if isinstance(card, str):
        raise CardError(f"{card_url}: {card}")
    return card


def status_url(card: AgentCardView) -> str:
    """What our card registers as the status URL of an A2A agent: the reaper asks GetTask."""
    return f"{STATUS_SCHEME}{card.protocol}:{card.rpc_url}"


class A2ATransport:
    wants_callbacks = True

    def __init__(
        self,
        card: AgentCardView,
        *,
        timeout_s: float,
        max_connections: int,
        max_result_bytes: int = 1024 * 1024,
    ) -> None:
        self.card = card
        self.dialect = DIALECTS[card.protocol]
        self.max_result_bytes = max_result_bytes
        self.callback_base = ""
        self.tokens: CallbackTokens | None = None
        self.timeout_s = timeout_s
        # told each status update a streaming agent sends on the way (the sidecar notes it)
        self.on_update: Callable[[str, str], Awaitable[None]] | None = None
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=agent_limits(max_connections),
        )

    @property
    def streams(self) -> bool:
        """Whether attempts are streamed: the card offers it, over JSON-RPC."""
        return self.card.streaming and not self.dialect.rest

    @property
    def pushes(self) -> bool:
        """Whether the agent tells the sidecar when a task ends (else the sidecar asks)."""
        return self.card.push and bool(self.callback_base)

    def bind_callbacks(self, base_url: str, tokens: CallbackTokens) -> None:
        self.callback_base = base_url.rstrip("/")
        self.tokens = tokens

    async def deliver(self, envelope: Envelope, attempt: int) -> Outcome:
        message_id = envelope.message_id
        push = None
        if self.pushes and self.tokens is not None:
            url = f"{self.callback_base}{A2A_PATH}{message_id}"
            push = (url, self.tokens.token(message_id, attempt))
        metadata = {
            "reach": {
                "message_id": message_id,
                "attempt": attempt,
                "idempotency_key": envelope.idempotency,
                "capability": envelope.capability,
                **({"traceparent": envelope.traceparent} if envelope.traceparent else {}),
            }
        }
        params = send_params(
            self.dialect,
            message_id=f"{message_id}.{attempt}",
            payload=bytes(envelope.payload),
            metadata=metadata,
            push=push,
            streaming=self.streams,
        )
        if self.streams:
            return await self._streamed(message_id, params, reach_headers(envelope, attempt))
        answer = await self._call(self.dialect.send, params, reach_headers(envelope, attempt))
        return self._answered(answer) if isinstance(answer, AgentAnswer) else answer

    async def _streamed(
        self, message_id: str, params: dict[str, Any], headers: dict[str, str]
    ) -> Outcome:
        """``SendStreamingMessage``, read to the end (:mod:`adapters.a2a_stream`)."""
        url = self.card.rpc_url
        sent = {**headers, **self.dialect.headers(), "Content-Type": "application/json"}
        sent["Accept"] = "text/event-stream"
        body = rpc(self.dialect.stream, params, uuid.uuid4().hex)
        reading = StreamReading()
        note = self._noter(message_id)
        # the whole call within its time: httpx bounds each read, and an agent trickling its
        # headers or a plain answer a byte at a time would hold the call for good
        sending = SendWatch()
        watched = {"trace": sending.trace}
        with anyio.move_on_after(self.timeout_s) as deadline:
            try:
                async with self._client.stream(
                    "POST", url, content=body, headers=sent, extensions=watched
                ) as answer:
                    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
                        raw = await read_limited(answer, self.max_result_bytes) or b""
                        return self._answered(AgentAnswer(answer.status_code, answer.headers, raw))
                    await consume(answer, reading, note, self.timeout_s)
            except NOT_SENT as exc:
                return NotReached(f"agent unreachable at {url}: {type(exc).__name__}: {exc}")
            except httpx.HTTPError as exc:
                if not reading.task_id:
                    return Ambiguous(f"no answer from {url}: {type(exc).__name__}: {exc}")
        if deadline.cancelled_caught and not sending.started:
            return NotReached(f"agent unreachable at {url}: not connected in {self.timeout_s:g} s")
        if deadline.cancelled_caught and not reading.task_id:
            return Ambiguous(f"no answer from {url} within {self.timeout_s:g} s")
        settled = stream_outcome(reading)
        if not isinstance(settled, str):
            return settled
        view = await self.task(settled)  # it ended: the task, with its artifacts
        return outcome_of(view) if isinstance(view, TaskView) else Accepted(settled)

    def _noter(self, message_id: str) -> Update | None:
        """What notes a call's status updates on the timeline: the first
        :data:`MAX_NOTED_UPDATES` of them, then one note that the rest were not (each is a
        write to Redis; an agent that streams thousands must not make thousands)."""
        on_update = self.on_update
        if on_update is None:
            return None
        noted = 0

        async def note(words: str) -> None:
            nonlocal noted
            noted += 1
            if noted <= MAX_NOTED_UPDATES:
                await on_update(message_id, words)
            elif noted == MAX_NOTED_UPDATES + 1:
                await on_update(message_id, f"more status updates: not noted past {noted - 1}")

        return note

    def _answered(self, answer: AgentAnswer) -> Outcome:
        """A send's answer that is no event stream: an HTTP status, or one JSON-RPC answer."""
        checked = http_outcome(answer)
        if not isinstance(checked, AgentAnswer):
            return checked
        result = rpc_answer(checked.body)
        if isinstance(result, RpcError):
            return Failed(str(result))
        view = sent_task(result)
        return Failed(view) if isinstance(view, str) else outcome_of(view)

    async def task(self, task_id: str) -> TaskView | RpcError | str:
        """``GetTask``: what the task says now, or why that is not known."""
        answer = await self._call(self.dialect.get, {"id": task_id}, {})
        if not isinstance(answer, AgentAnswer):
            return getattr(answer, "reason", "no answer")
        result = rpc_answer(answer.body)
        return result if isinstance(result, RpcError) else task_view(result)

    async def cancel(self, task_id: str) -> TaskView | RpcError | str:
        """``CancelTask``."""
        answer = await self._call(self.dialect.cancel, {"id": task_id}, {})
        if not isinstance(answer, AgentAnswer):
            return getattr(answer, "reason", "no answer")
        result = rpc_answer(answer.body)
        return result if isinstance(result, RpcError) else task_view(result)

    async def _call(
        self, method: str, params: dict[str, Any], headers: dict[str, str]
    ) -> AgentAnswer | Outcome:
        return await json_rpc(
            self._client,
            self.card.rpc_url,
            self.dialect,
            (method, params, headers),
            max_bytes=self.max_result_bytes,
        )

    async def aclose(self) -> None:
        await self._client.aclose()
