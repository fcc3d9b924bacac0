"""What a producer is told, and the reader that hands it to the request waiting for it.

A reply stream holds :class:`broker.wire.ReplyEntry` entries: outcomes, and notices that are
no outcome (``deadline_passed``, ``replayed``). A :class:`Result` is an outcome as a producer
sees it, its JSON result decoded.

An open ``Client`` has one reply stream and one :class:`ReplyInbox`: a single reader task
blocks on the stream with ``XREAD`` and hands each outcome to the request waiting for its id,
so any number of concurrent requests share one stream and one dedicated connection. Consumed
entries are deleted as the reader goes (``XDEL``), best effort: a user that may not (a
producer on Redis 6.2) leaves them to the stream's TTL (``reply_ttl_s`` after its last
answer).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from .connection import Connection
from .errors import RedisReplyError, RedisUnavailable
from .stages import Stage
from .wire import ReplyEntry, parse_reply_entry

log = logging.getLogger("agent_reach.client")

# How long one blocking XREAD of the reply stream lasts; cancellation ends it at once.
_REPLY_BLOCK_MS = 5000
_REPLY_BATCH = 1000
# The reader's pause after Redis failed it: it reconnects on its next read.
_RECONNECT_S = (0.05, 2.0)


class Result(msgspec.Struct, frozen=True):
    """A message's outcome as a producer sees it."""

    id: str
    stage: Stage
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.stage is Stage.SUCCEEDED


def result_of(entry: ReplyEntry) -> Result:
    """The outcome ``entry`` holds (its result JSON, checked by the parser, decoded)."""
    result = msgspec.json.decode(entry.result) if entry.result else None
    return Result(entry.id, entry.stage, result, entry.error)


def answer_in(fields: Mapping[str, bytes]) -> Result | None:
    """The outcome a reply-stream entry holds, or ``None`` for a notice or an entry that
    holds none (whoever may write the stream may have written anything): never raises."""
    entry = parse_reply_entry(fields)
    if isinstance(entry, str):
        log.warning("unreadable reply entry %.300r: %s", dict(fields), entry)
        return None
    return result_of(entry) if entry.is_outcome else None


def result_from_fields(fields: Mapping[str, bytes]) -> Result:
    """The outcome an entry the caller knows to be one holds (tests, benchmarks: a notice
    is passed over before); :class:`ValueError` with the reason when it is unreadable."""
    entry = parse_reply_entry(fields)
    if isinstance(entry, str):
        raise ValueError(f"unreadable reply entry: {entry}")
    return result_of(entry)


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting for its outcome."""

    done: anyio.Event = field(default_factory=anyio.Event)
    result: Result | None = None
    request: str = ""  # its request's digest: a refusal naming it is its answer


class ReplyInbox:
    """One reply stream, read by one task (:meth:`read`) for the requests waiting on it."""

    def __init__(self, conn: Connection, stream: str) -> None:
        self.conn = conn
        self.stream = stream
        self._waiters: dict[str, Waiter] = {}
        self._consumed: list[str] = []
        self._may_delete = True  # False once Redis refused this user XDEL on the stream
        self.failure: RedisReplyError | None = None  # Redis refused the reading: it stopped

    @contextmanager
    def expecting(self, message_id: str, request: str = "") -> Iterator[Waiter]:
        """Wait for ``message_id``'s outcome within the block; :class:`ValueError` when a
        request for that id is already waiting. ``request`` is the request's digest
        (:func:`broker.envelope.request_digest`): a refusal of that very request ends the
        wait too (``id_conflict``: the id names another message)."""
        if message_id in self._waiters:
            raise ValueError(f"a request for message id {message_id!r} is already waiting")
        waiter = self._waiters[message_id] = Waiter(request=request)
        try:
            yield waiter
        finally:
            del self._waiters[message_id]

    def raise_failure(self) -> None:
        """:class:`RedisReplyError` when Redis refused the reading of this stream."""
        if self.failure is not None:
            raise RedisReplyError(self.failure.message) from self.failure

    def wake_all(self) -> None:
        """Wake every waiting request without an outcome: the client is closing."""
        for waiter in self._waiters.values():
            waiter.done.set()

    async def read(self) -> None:
        """Hand every outcome on the stream to the request waiting for it, until cancelled;
        Redis failing the read is retried, the requests waiting on, bounded by their
        timeouts. Redis refusing it (``NOPERM``; ``WRONGTYPE``: the key is no stream any
        more) will not change: the reading stops, and every request waiting or made later
        is told so (:attr:`failure`), rather than the client's host ending or each request
        waiting out its timeout."""
        after = "0"  # the stream is new: nothing on it is older than the first request
        pause = _RECONNECT_S[0]
        async with self.conn.reader() as reader:
            while True:
                try:
                    entries = await reader.read_stream(
                        self.stream, after, count=_REPLY_BATCH, block_ms=_REPLY_BLOCK_MS
                    )
                    pause = _RECONNECT_S[0]
                    if entries:
                        after = entries[-1][0]
                        for _, fields in entries:
                            self._resolve(fields)
                        await self._forget([entry_id for entry_id, _ in entries])
                except RedisUnavailable as exc:
                    log.warning(
                        "reply stream %s: %s; reading again in %.2fs", self.stream, exc, pause
                    )
                    await anyio.sleep(pause)
                    pause = min(pause * 2, _RECONNECT_S[1])
                except RedisReplyError as exc:
                    log.error("reply stream %s cannot be read: %s", self.stream, exc)
                    self.failure = exc
                    self.wake_all()
                    return

    def _resolve(self, fields: Mapping[str, bytes]) -> None:
        """Hand an outcome to its waiter. Notices are not outcomes — but a refusal that
        names the waiter's very request is its answer; an entry for an id nobody waits on (a
        request that timed out, a repeated reply) is dropped."""
        entry = parse_reply_entry(fields)
        if isinstance(entry, str):
            log.warning("unreadable reply entry %.300r: %s", dict(fields), entry)
            return
        waiter = self._waiters.get(entry.id)
        if waiter is None or waiter.done.is_set():
            return
        if entry.is_outcome or (entry.request and entry.request == waiter.request):
            waiter.result = result_of(entry)
            waiter.done.set()

    async def _forget(self, entry_ids: list[str]) -> None:
        """``XDEL`` what the reader consumed, so a long-lived client's stream stays short.
        Ids a failed ``XDEL`` left are retried with the next batch; a user refused ``XDEL``
        stops trying."""
        if not self._may_delete:
            return
        self._consumed.extend(entry_ids)
        try:
            await self.conn.call("XDEL", self.stream, *self._consumed)
        except RedisUnavailable:
            return
        except RedisReplyError as exc:
            if exc.code != "NOPERM":
                raise
            self._may_delete = False
            log.info("reply stream %s: not trimmed, its user may not XDEL (%s)", self.stream, exc)
        self._consumed.clear()
