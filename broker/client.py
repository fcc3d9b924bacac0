"""The producer client: submit envelopes, await results, read records and timelines.

``await client.request(...)`` waits on the client's own reply stream, made on the first
request: ``P:reply:<user>-<hex>`` when the Redis URL names a user (so an ACL can give each
producer its own streams and no one else's, see ``agent-reach acl``), else
``P:reply:client-<hex>``. One reader task per client (:class:`broker.replies.ReplyInbox`)
hands each outcome to the request waiting for its id, so any number of concurrent requests
share one stream and one dedicated connection; their submits are coalesced by the pipeliner.
Consumed entries are deleted as the reader goes, and the stream itself when the client closes.
Both deletions are best effort: a user that may not run them (a producer on Redis 6.2, which
cannot grant ``XDEL`` and ``DEL`` on some keys only) leaves the stream to its TTL: it expires
``reply_ttl_s`` after its last answer.

A producer needs nothing but ``XADD`` on the ingress stream to submit, and ``XREAD`` on its
own reply streams to wait: never ``SCRIPT LOAD`` (scripts are loaded by the processes that run
them) nor read access to records (``result`` and ``trace`` need that). Where a dispatcher
publishes direct lanes (``direct_lane``) and the producer's user may write records (no
producer ACL), :meth:`Client.submit` assigns a plain envelope itself, one hop sooner
(:mod:`broker.direct`); ``submit_many`` always sends to the ingress.

:class:`SyncClient` is the same client for scripts: it runs on its own event loop thread.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import ExitStack, asynccontextmanager, contextmanager
from functools import partial
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal, start_blocking_portal

from . import tracing
from .acl import PRODUCER_NAME
from .config import Settings, answer_grace_s, load_settings
from .connection import Connection, open_connection
from .direct import DirectLane
from .embedded import embedded_redis
from .envelope import Envelope, check_envelope, complete, encode_envelope, request_digest
from .errors import (
    ClientNotOpen,
    InvalidEnvelope,
    RedisReplyError,
    RequestTimeout,
    UnknownMessage,
    UnreadableRecord,
)
from .feedback import record_feedback
from .keyspace import ingress_for
from .records import MessageRecord, TimelineEntry
from .replies import ReplyInbox, Result, answer_in, result_from_fields
from .stages import TERMINAL
from .store import MessageStore

__all__ = [
    "Client",
    "Result",
    "SyncClient",
    "Trace",
    "answer_in",
    "reply_stream_owner",
    "request_envelope",
    "result_from_fields",
]

log = logging.getLogger("agent_reach.client")


def reply_stream_owner(url: str) -> str:
    """Whose reply streams a client on ``url`` makes: the URL's Redis user when it has one
    (``agent-reach acl`` grants a producer ``P:reply:<user>-*``), else ``client``."""
    try:
        user = urlsplit(url).username
    except ValueError:
        return "client"
    name = unquote(user) if user else ""
    # the rule `agent-reach acl` names producers by; any other user falls back to "client"
    return name if PRODUCER_NAME.fullmatch(name) else "client"


class Trace(msgspec.Struct, frozen=True):
    record: MessageRecord
    timeline: list[TimelineEntry]


class Client:
    """A producer on one connection.

    ``submit``, ``submit_many``, ``result`` and ``trace`` work on a bare ``Client(conn)``;
    ``request`` needs the client open (``async with Client(conn) as client:``), which owns
    the reply stream's reader task and deletes the stream on exit.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.store = MessageStore(conn)
        self.direct = DirectLane(conn)
        tracing.use_installed_provider()
        self._tg: TaskGroup | None = None
        self._inbox: ReplyInbox | None = None

    def new_reply_stream(self) -> str:
        """A new reply stream name of this client's own: ``P:reply:<owner>-<hex>``, the owner
        being the Redis user of the connection (:func:`reply_stream_owner`)."""
        owner = reply_stream_owner(self.conn.url)
        return self.keys.reply(f"{owner}-{secrets.token_hex(8)}")

    async def discard_reply_stream(self, stream: str) -> None:
        """Delete a reply stream no one will read any more. Best effort: a user refused
        ``DEL`` (a producer on Redis 6.2) leaves it to expire ``reply_ttl_s`` after its last
        answer. A lost connection is raised."""
        try:
            await self.conn.call("DEL", stream)
        except RedisReplyError as exc:
            if exc.code != "NOPERM":
                raise
            log.debug("reply stream %s is left to its TTL: %s", stream, exc)

    @property
    def reply_stream(self) -> str | None:
        """This client's own reply stream, once a request has made it."""
        return self._inbox.stream if self._inbox is not None else None

    async def __aenter__(self) -> Client:
        if self._tg is not None:
            raise RuntimeError("this Client is already open")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg, self._tg = self._tg, None
        assert tg is not None
        if self._inbox is not None:  # requests in other tasks: the client closed
            self._inbox.wake_all()
        tg.cancel_scope.cancel()
        try:
            # The body's own exception is not passed in: it propagates as it is, not wrapped
            # in an ExceptionGroup; only a failure of the reader itself comes from here.
            await tg.__aexit__(None, None, None)
        finally:
            inbox, self._inbox = self._inbox, None
            if inbox is not None:
                with anyio.CancelScope(shield=True):
                    await self.discard_reply_stream(inbox.stream)

    async def request(
        self,
        capability: str,
        payload: Any,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109 - also the message's deadline, sent to the broker
        wait_s: float | None = None,
        **envelope_fields: Any,
    ) -> Result:
        """Submit ``payload`` (any JSON-able value) to ``capability`` and await its outcome.

        The envelope's deadline (``timeout_s``) is ``timeout``; ``envelope_fields`` are any
        other envelope fields (``id``, ``session_id``, ``tags``, ``priority``, …). Returns
        the terminal :class:`Result` (a failure is a Result with ``ok`` false); raises
        :class:`RequestTimeout`, carrying the id for a later :meth:`result`, when none
        arrived in time, :class:`InvalidEnvelope` when the fields do not validate, and
        :class:`RedisReplyError` when Redis refuses to let the reply stream be read.

        ``wait_s`` is how long to wait for the answer: by default ``timeout`` plus the
        broker's grace (:func:`~broker.config.answer_grace_s`), so a message that ends at
        its deadline (EXPIRED, with why nothing served it) comes back as that answer.
        """
        inbox = self._open_inbox()
        envelope = request_envelope(capability, payload, timeout, inbox.stream, envelope_fields)
        message_id = envelope.message_id
        waited = timeout + answer_grace_s(self.conn.settings) if wait_s is None else wait_s
        with inbox.expecting(message_id, request_digest(envelope)) as waiter:
            # a cancel waits for the submit's one round trip: cut in the middle, the write is
            # sent or not (no one can tell) and the connection it was on is dropped
            with anyio.CancelScope(shield=True):
                await self.submit(envelope)
            with anyio.move_on_after(waited):
                await waiter.done.wait()
        if waiter.result is not None:
            return waiter.result
        inbox.raise_failure()
        if self._tg is None:
            raise ClientNotOpen(f"the client closed while request {message_id!r} waited")
        raise RequestTimeout(message_id, waited)

    async def broadcast(
        self,
        capability: str,
        payload: Any,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109 - also the broadcast's deadline, sent to the broker
        **envelope_fields: Any,
    ) -> Result:
        """Send ``payload`` to every healthy instance of ``capability`` and await the outcome.

        ``result`` maps instance id -> ``{"stage", "id", "result" | "error"}``, one entry per
        child, once every child has ended: the broadcast succeeds whatever its children's
        outcomes (a failed child is an entry, not a failure). REJECTED (``ok`` false, the
        reason in ``error``) when no healthy instance serves it. Needs an open client, like
        :meth:`request`; raises :class:`RequestTimeout` when not every child ended in time."""
        return await self.request(
            capability, payload, timeout=timeout, mode="broadcast", **envelope_fields
        )

    def _open_inbox(self) -> ReplyInbox:
        """The reply stream, with its reader started on the first request."""
        if self._tg is None:
            raise ClientNotOpen(
                "Client.request() needs an open client: use `async with Client(conn) as client:`"
            )
        if self._inbox is None:
            self._inbox = ReplyInbox(self.conn, self.new_reply_stream())
            self._tg.start_soon(self._inbox.read)
        self._inbox.raise_failure()  # nothing is sent whose answer could not be read
        return self._inbox

    async def submit(self, envelope: Envelope) -> str:
        """``XADD`` one envelope to the ingress stream; returns its id (assigned here if absent)."""
        envelope = complete(envelope)
        check_envelope(envelope)  # what the dispatcher would reject, refused here already
        stream = self._ingress_for(envelope)
        with tracing.sending(envelope, stream) as sent:
            raw = encode_envelope(sent)
            instance = await self.direct.submit(sent, raw, stream)  # its capability's lane ...
            if instance is None:  # ... or the ingress
                await self.conn.call("XADD", stream, "*", "envelope", raw)
            else:
                tracing.sent_directly(self.keys.queue(instance), instance)
        return envelope.message_id

    def _ingress_for(self, envelope: Envelope) -> str:
        """The ingress partition of ``envelope`` (``ingress_partitions``)."""
        key = envelope.session_id or envelope.message_id
        return ingress_for(self.keys, key, self.conn.settings.ingress_partitions)

    async def submit_many(self, envelopes: list[Envelope]) -> list[str]:
        """Submit a batch in one pipelined round trip."""
        done = [complete(e) for e in envelopes]
        for envelope in done:
            check_envelope(envelope)
        streams = [self._ingress_for(e) for e in done]
        with ExitStack() as spans:  # one send span each, when tracing is on
            sent = [
                spans.enter_context(tracing.sending(e, stream))
                for e, stream in zip(done, streams, strict=True)
            ]
            replies = await self.conn.call_many(
                [
                    ("XADD", stream, "*", "envelope", encode_envelope(e))
                    for e, stream in zip(sent, streams, strict=True)
                ]
            )
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [e.message_id for e in done]

    async def wait_reply(
        self, reply_to: str, message_id: str, *, timeout_s: float
    ) -> Result | None:
        """Block on a reply stream until ``message_id``'s result arrives, or the timeout.
        Notices on the way (``deadline_passed`` while the agent still works) are skipped:
        only the outcome is returned."""
        last = "0"
        async with self.conn.reader() as reader:
            with anyio.move_on_after(timeout_s):
                while True:
                    for entry_id, fields in await reader.read_stream(reply_to, last, block_ms=1000):
                        last = entry_id
                        answer = answer_in(fields)
                        if answer is not None and answer.id == message_id:
                            return answer
        return None

    async def result(self, message_id: str) -> Result | None:
        """The terminal result from the record, or ``None`` while the message is in flight."""
        record = await self.store.get_record(message_id)
        if record is None:
            raise UnknownMessage(message_id)
        if record.stage not in TERMINAL:
            return None
        return Result(
            record.id,
            record.stage,
            msgspec.json.decode(record.result) if record.result else None,
            record.error,
        )

    async def trace(self, message_id: str) -> Trace:
        """The record and its timeline; raises :class:`UnknownMessage` when there is no
        record, :class:`UnreadableRecord` when what is there does not read as one."""
        record = await self.store.get_record(message_id)
        if record is None and await self.conn.call("EXISTS", self.conn.keys.record(message_id)):
            record = await self.store.get_record(message_id)  # made just now, perhaps
            if record is None:
                raise UnreadableRecord(message_id)
        if record is None:
            raise UnknownMessage(message_id)
        return Trace(record, await self.store.get_timeline(message_id))

    async def feedback(self, message_id: str, good: bool) -> str:
        """Rate the agent that ran ``message_id`` (:mod:`broker.feedback`); returns its id.
        Its recent approval enters intent routing. Raises :class:`UnknownMessage` for an
        unknown id, :class:`~broker.feedback.FeedbackError` when no agent ran it. Reads the
        record and card: an ``operator`` user may, a ``producer`` may not."""
        return await record_feedback(self.conn, message_id, good=good)


def request_envelope(
    capability: str, payload: Any, timeout_s: float, reply_to: str, fields: Mapping[str, Any]
) -> Envelope:
    """The completed envelope of one request (id filled), validated like the dispatcher's."""
    owned = sorted({"reply_to", "timeout_s"} & fields.keys())
    if owned:
        raise TypeError(f"request() sets {', '.join(owned)} itself (use timeout= for the deadline)")
    values = {**fields, "capability": capability, "timeout_s": timeout_s, "reply_to": reply_to}
    try:
        envelope = msgspec.convert(values, Envelope)
    except msgspec.ValidationError as exc:
        raise InvalidEnvelope(f"invalid envelope: {exc}", b"") from exc
    raw = msgspec.Raw(msgspec.json.encode(payload))
    return complete(msgspec.structs.replace(envelope, payload=raw))


class SyncClient:
    """The client for scripts (not async): the async :class:`Client` on its own event loop
    thread, through an anyio blocking portal. Use it as a context manager::

        with SyncClient("redis://127.0.0.1:6379/0") as client:
            result = client.request("text.echo", {"x": 1}, timeout=5)

    The Redis URL is ``redis_url``, else ``settings.redis_url`` (settings default to
    :func:`load_settings`: ``AGENT_REACH_*`` and ``AGENT_REACH_CONFIG``), else the embedded
    server. Its methods may be called from several threads at once.
    """

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None) -> None:
        self.settings = settings if settings is not None else load_settings()
        self._url = redis_url or self.settings.redis_url
        self._stack: ExitStack | None = None
        self._portal: BlockingPortal | None = None
        self._client: Client | None = None

    def __enter__(self) -> SyncClient:
        if self._stack is not None:
            raise RuntimeError("this SyncClient is already open")
        with ExitStack() as stack:
            url = self._url or stack.enter_context(embedded_redis())
            portal = stack.enter_context(start_blocking_portal(backend="asyncio"))
            opened = _open_client(self.settings, url)
            self._client = stack.enter_context(portal.wrap_async_context_manager(opened))
            self._portal = portal
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._portal = self._client = None
        if stack is not None:
            stack.close()

    def request(
        self, capability: str, payload: Any, *, timeout: float = 30.0, **envelope_fields: Any
    ) -> Result:
        """:meth:`Client.request`, blocking."""
        with self._open() as (portal, client):
            call = partial(client.request, capability, payload, timeout=timeout, **envelope_fields)
            return portal.call(call)

    def broadcast(
        self, capability: str, payload: Any, *, timeout: float = 30.0, **envelope_fields: Any
    ) -> Result:
        """:meth:`Client.broadcast`, blocking."""
        with self._open() as (portal, client):
            call = partial(
                client.broadcast, capability, payload, timeout=timeout, **envelope_fields
            )
            return portal.call(call)

    def submit(self, envelope: Envelope) -> str:
        with self._open() as (portal, client):
            return portal.call(client.submit, envelope)

    def submit_many(self, envelopes: list[Envelope]) -> list[str]:
        with self._open() as (portal, client):
            return portal.call(client.submit_many, envelopes)

    def result(self, message_id: str) -> Result | None:
        with self._open() as (portal, client):
            return portal.call(client.result, message_id)

    def trace(self, message_id: str) -> Trace:
        with self._open() as (portal, client):
            return portal.call(client.trace, message_id)

    def feedback(self, message_id: str, good: bool) -> str:
        """:meth:`Client.feedback`, blocking."""
        with self._open() as (portal, client):
            return portal.call(client.feedback, message_id, good)

    @contextmanager
    def _open(self) -> Iterator[tuple[BlockingPortal, Client]]:
        if self._portal is None or self._client is None:
            raise ClientNotOpen(
                "SyncClient needs to be open: use `with SyncClient(...) as client:`"
            )
        yield self._portal, self._client


@asynccontextmanager
async def _open_client(settings: Settings, url: str) -> AsyncIterator[Client]:
    async with open_connection(settings, url) as conn, Client(conn) as client:
        yield client
