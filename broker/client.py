"""The producer client: submit envelopes, wait for results, read records and timelines."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec

from .connection import Connection
from .envelope import Envelope, complete, encode_envelope
from .errors import UnknownMessage
from .records import MessageRecord, TimelineEntry
from .stages import TERMINAL, Stage
from .store import MessageStore


class Result(msgspec.Struct, frozen=True):
    """A message's outcome as a producer sees it."""

    id: str
    stage: Stage
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.stage is Stage.SUCCEEDED


class Trace(msgspec.Struct, frozen=True):
    record: MessageRecord
    timeline: list[TimelineEntry]


class Client:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys = conn.keys
        self.store = MessageStore(conn)

    def new_reply_stream(self) -> str:
        return self.keys.reply(f"client-{secrets.token_hex(8)}")

    async def submit(self, envelope: Envelope) -> str:
        """``XADD`` one envelope to the ingress stream; returns its id (assigned here if absent)."""
        envelope = complete(envelope)
        await self.conn.call("XADD", self.keys.ingress, "*", "envelope", encode_envelope(envelope))
        return envelope.message_id

    async def submit_many(self, envelopes: list[Envelope]) -> list[str]:
        """Submit a batch in one pipelined round trip."""
        done = [complete(e) for e in envelopes]
        replies = await self.conn.call_many(
            [("XADD", self.keys.ingress, "*", "envelope", encode_envelope(e)) for e in done]
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
                        mine = fields.get("id", b"").decode() == message_id
                        if mine and "notice" not in fields:
                            return result_from_fields(fields)
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
        record = await self.store.get_record(message_id)
        if record is None:
            raise UnknownMessage(message_id)
        return Trace(record, await self.store.get_timeline(message_id))


def result_from_fields(fields: Mapping[str, bytes]) -> Result:
    """A reply stream entry (fields ``id``, ``stage``, ``result`` or ``error``) as a Result."""
    raw = fields.get("result")
    error = fields.get("error")
    return Result(
        id=fields["id"].decode(),
        stage=Stage(fields["stage"].decode()),
        result=msgspec.json.decode(raw) if raw else None,
        error=error.decode() if error is not None else None,
    )
