"""Intake: what the dispatcher makes of ingress entries before it routes anything.

Anyone who can ``XADD`` to the ingress stream can write any bytes there, so nothing here
raises on what an entry holds. Each entry becomes either an envelope to admit or a rejection:
a REJECTED record with the precise reason (once per id), a dead letter holding the entry's
bytes (capped), and an answer on the producer's ``reply_to`` when one can be read from it.

Message ids. An envelope names its message, or the entry does: a ULID of the entry's time
(:func:`broker.ids.entry_message_id`), so that handling an entry twice names one message.
An entry whose time the clock has not reached — a producer's explicit id far ahead, or any
``*`` id Redis gives after one — gets a freshly minted id instead, kept beside the entry
(``SET NX`` on ``Keyspace.entry_name``) until the entry is acknowledged, so a re-handled
entry finds it again: no producer's entry id decides, or breaks, another message's id.

An id means one message. A producer re-sending an id with the same request (every field
but ``id``, ``reply_to``, ``callback_url``, ``traceparent`` and ``created_at``) gets the
existing message: nothing runs again, and when it has already ended the answer is sent to
the new ``reply_to`` too. A different request under an existing id is refused visibly —
REJECTED ``id_conflict`` on its ``reply_to`` and a dead letter — and the first message is
left untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.broadcast import id_problem
from broker.connection import Connection
from broker.deadletters import Letter, cap_bytes
from broker.entries import IngressEntry, MalformedEntry, parse_ingress
from broker.envelope import (
    Envelope,
    complete,
    decode_envelope,
    encode_envelope,
    request_fingerprint,
    salvage_id,
    salvage_reply_to,
)
from broker.errors import InvalidEnvelope
from broker.ids import entry_message_id, new_message_id
from broker.keyspace import DISPATCH_GROUP
from broker.records import MessageRecord
from broker.results import Command, reply_entry
from broker.stages import TERMINAL, Stage
from broker.store import Acceptance, MessageStore, now_ms
from broker.streams import RawEntry
from broker.webhooks import callback_problem
from broker.wire import reply_fields

log = logging.getLogger("agent_reach.intake")

ID_CONFLICT = "id_conflict"


@dataclass(frozen=True, slots=True)
class Rejection:
    """An entry refused before it became a message: why, its bytes, the id it names."""

    message_id: str
    reason: str
    raw: bytes
    reply_to: str
    source: str


@dataclass(slots=True)
class Intaken:
    """A batch read: the envelopes to admit, and the minted names to forget once the batch's
    entries are acknowledged."""

    envelopes: list[Envelope]
    minted: list[str]


class Intake:
    def __init__(self, conn: Connection, store: MessageStore) -> None:
        self.conn = conn
        self.store = store
        self.keys = conn.keys
        self.settings = conn.settings
        self.stream = conn.keys.ingress

    async def take(self, entries: Sequence[RawEntry], *, recovering: bool) -> Intaken:
        """Name, decode and validate a batch; the refused are rejected here, at once."""
        parsed = [parse_ingress(entry_id, flat) for entry_id, flat in entries]
        names, minted = await self._names([p.entry_id for p in parsed], recovering=recovering)
        envelopes: list[Envelope] = []
        rejections: list[Rejection] = []
        for item in parsed:
            outcome = self._judge(item, names[item.entry_id])
            if isinstance(outcome, Rejection):
                rejections.append(outcome)
            else:
                envelopes.append(outcome)
        await self.reject(rejections)
        return Intaken(envelopes, minted)

    async def acknowledge(self, entry_ids: Sequence[str], minted: Sequence[str]) -> None:
        """The batch is done: acknowledge its entries and forget the ids minted for them."""
        commands: list[Command] = [("XACK", self.stream, DISPATCH_GROUP, *entry_ids)]
        if minted:
            commands.append(("DEL", *minted))
        await self.store.run_all(commands)

    def rejection(self, entry_id: str, name: str, reason: str, raw: bytes) -> Rejection:
        """What refusing an entry needs: the id and ``reply_to`` salvaged from its bytes."""
        return Rejection(
            message_id=salvage_id(raw) or name,
            reason=reason,
            raw=raw,
            reply_to=salvage_reply_to(raw, self.keys.reply_prefix) or "",
            source=f"{self.stream} {entry_id}",
        )

    # -- naming --------------------------------------------------------------------------

    async def _names(
        self, entry_ids: list[str], *, recovering: bool
    ) -> tuple[dict[str, str], list[str]]:
        """The message id each entry names when its envelope has none; and the keys of the
        minted ones. One round trip, and only when some entry is ahead of the clock (or the
        batch is handled again: an entry may have been ahead at its first handling)."""
        now = now_ms()
        ttl_ms = self.settings.record_ttl_s * 1000
        names: dict[str, str] = {}
        commands: list[Command] = []
        asked: list[tuple[str, str]] = []  # entry id, key: answered by each GET
        for entry_id in entry_ids:
            derived = entry_message_id(self.stream, entry_id, now_ms=now)
            key = self.keys.entry_name(self.stream, entry_id)
            if derived is not None:
                names[entry_id] = derived
                if not recovering:
                    continue
            else:
                commands.append(("SET", key, new_message_id(), "NX", "PX", ttl_ms))
            commands.append(("GET", key))
            asked.append((entry_id, key))
        if not commands:
            return names, []
        answered = zip(await self._run(commands), commands, strict=True)
        replies = [reply for reply, command in answered if command[0] == "GET"]
        minted = []
        for (entry_id, key), value in zip(asked, replies, strict=True):
            if value:
                names[entry_id] = value.decode()
                minted.append(key)
        return names, minted

    async def _run(self, commands: list[Command]) -> list[Any]:
        replies = await self.conn.call_many(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    # -- judging -------------------------------------------------------------------------

    def _judge(self, item: IngressEntry | MalformedEntry, name: str) -> Envelope | Rejection:
        if isinstance(item, MalformedEntry):
            return self.rejection(item.entry_id, name, item.reason, item.raw)
        try:
            return self._decode(item.envelope, name)
        except InvalidEnvelope as exc:
            return self.rejection(item.entry_id, name, exc.reason, exc.raw)

    def _decode(self, raw: bytes, name: str) -> Envelope:
        envelope = decode_envelope(
            raw, max_bytes=self.settings.max_envelope_bytes, reply_prefix=self.keys.reply_prefix
        )
        if envelope.parent is not None:
            raise InvalidEnvelope("invalid envelope: `parent` is set by the broker only", raw)
        if envelope.callback_url is not None and (
            problem := callback_problem(
                envelope.callback_url, self.settings.callback_hosts, self.settings.webhook_secret
            )
        ):
            raise InvalidEnvelope(problem, raw)
        if envelope.id is None:
            envelope = msgspec.structs.replace(envelope, id=name)
        if envelope.mode == "broadcast" and (problem := id_problem(envelope.id or "")):
            raise InvalidEnvelope(problem, raw)
        return complete(envelope)

    # -- refusing ------------------------------------------------------------------------

    async def reject(self, rejections: Sequence[Rejection]) -> None:
        """Record each as REJECTED (once per id), dead-letter its bytes, tell its producer
        where it left a usable ``reply_to``: a few round trips for the lot. Handled again
        (a restart mid-batch), an entry is told again — at least once; an id that already
        names another message is left as it is, and the refusal says so."""
        if not rejections:
            return
        max_bytes = self.settings.dlq_entry_max_bytes
        accepted = await self.store.accept_many(
            [self._rejected_record(r, max_bytes) for r in rejections]
        )
        taken = [r.message_id for r, a in zip(rejections, accepted, strict=True) if not a.created]
        records = dict(zip(taken, await self.store.get_records(taken), strict=True))
        owners: list[str] = []
        commands: list[Command] = []
        for r, a in zip(rejections, accepted, strict=True):
            reason = r.reason
            if not a.created and not _ours(records.get(r.message_id), r.raw, max_bytes):
                reason = f"{reason}; id {r.message_id} already names another message"
            commands.append(self.store.dead_letter_command(self._letter(r, reason)))
            owners.append(r.message_id)
            if r.reply_to:
                for command in self._answer(r.reply_to, r.message_id, reason):
                    commands.append(command)
                    owners.append(r.message_id)
            log.info("message %s rejected: %s", r.message_id, reason)
        await self.store.after_delivery(owners, commands, await self.conn.call_many(commands))

    def _rejected_record(self, r: Rejection, max_bytes: int) -> Acceptance:
        kept, size = cap_bytes(r.raw, max_bytes)
        return Acceptance(
            r.message_id,
            kept,
            capability="",
            deadline_ms=0,
            reply_to=r.reply_to,
            priority=0,
            next_stage=Stage.REJECTED,
            accepted_ms=now_ms(),
            reason=r.reason,
            fields={"envelope_size": str(size)} if size is not None else None,
        )

    def _letter(self, r: Rejection, reason: str) -> Letter:
        return Letter(
            id=r.message_id,
            stage=Stage.REJECTED.value,
            reason=reason,
            raw=r.raw,
            source=r.source,
            ts_ms=now_ms(),
        )

    def _answer(self, reply_to: str, message_id: str, error: str) -> list[Command]:
        entry = reply_entry(message_id, Stage.REJECTED, None, error)
        return [
            ("XADD", reply_to, "*", *reply_fields(entry)),
            ("EXPIRE", reply_to, self.settings.reply_ttl_s),
        ]

    # -- one id, one message -------------------------------------------------------------

    def same_request(self, record: MessageRecord, planned: Envelope) -> bool:
        """Whether ``planned`` asks for what the existing record's message asks for."""
        try:
            stored = msgspec.json.decode(record.envelope, type=Envelope)
        except msgspec.DecodeError:  # a REJECTED record keeps whatever bytes it was sent
            return False
        return request_fingerprint(stored) == request_fingerprint(planned)

    async def conflict(self, record: MessageRecord, planned: Envelope) -> None:
        """``planned`` reuses the id of another message: refused visibly, the first untouched."""
        reason = (
            f"{ID_CONFLICT}: id {record.id} already names another message (accepted "
            "earlier with a different request); choose a new id"
        )
        letter = Letter(
            id=record.id,
            stage=Stage.REJECTED.value,
            reason=reason,
            raw=encode_envelope(planned),
            ts_ms=now_ms(),
        )
        commands = [self.store.dead_letter_command(letter)]
        if planned.reply_to:
            commands += self._answer(planned.reply_to, record.id, reason)
        owners = [record.id] * len(commands)
        await self.store.after_delivery(owners, commands, await self.conn.call_many(commands))
        log.warning("message %s: %s", record.id, reason)

    async def tell_again(self, record: MessageRecord, planned: Envelope) -> None:
        """A producer's retry of a message that has ended, from another reply stream: its
        answer goes there too (the first producer's stream had it already)."""
        if not planned.reply_to or planned.reply_to == record.reply_to:
            return
        if record.stage not in TERMINAL:
            return
        retry = msgspec.structs.replace(planned, callback_url=None, parent=None)
        await self.store.deliver(
            retry, record.stage, record.result, record.error, attempt=record.attempt
        )


def _ours(record: MessageRecord | None, raw: bytes, max_bytes: int) -> bool:
    """Whether an existing record is this very rejection, written by an earlier handling."""
    return (
        record is not None
        and record.stage is Stage.REJECTED
        and record.envelope == cap_bytes(raw, max_bytes)[0]
    )
