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
existing message: nothing runs again, and its answer goes where the first one asked. A
different request under an existing id is refused visibly — a dead letter, and on its
``reply_to`` a notice ``id_conflict`` naming the refused request (its digest), which its
own producer's client takes as its answer and no other client does — and the first message
is left untouched. An invalid envelope's rejection holds no id: a valid envelope under it
takes it (``lua/accept.lua``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.broadcast import id_problem
from broker.connection import Connection
from broker.deadletters import Letter, cap_bytes
from broker.delivery import dead_letter_commands
from broker.entries import IngressEntry, MalformedEntry, parse_ingress
from broker.envelope import (
    Envelope,
    complete,
    decode_envelope,
    encode_envelope,
    request_digest,
    request_fingerprint,
    salvage_id,
    salvage_reply_to,
)
from broker.errors import InvalidEnvelope, RedisReplyError
from broker.ids import entry_message_id, new_message_id
from broker.keyspace import DISPATCH_GROUP
from broker.records import Accepted, MessageRecord
from broker.results import Command
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.streams import RawEntry
from broker.timekeeping import now_ms
from broker.webhooks import callback_problem
from broker.wire import ReplyEntry, reply_fields

log = logging.getLogger("agent_reach.intake")

ID_CONFLICT = "id_conflict"
REJECTED_NOTICE = "rejected"  # an entry refused under an id that names another message


@dataclass(frozen=True, slots=True)
class Rejection:
    """An entry refused before it became a message: why, its bytes, the id it names."""

    message_id: str
    reason: str
    raw: bytes
    reply_to: str
    source: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an entry is refused, its bytes, and (an entry with other fields) the envelope
    among them, to salvage an id and a ``reply_to`` from."""

    reason: str
    raw: bytes
    salvage: bytes | None = None


@dataclass(slots=True)
class Intaken:
    """A batch read: the envelopes to admit, and the minted names to forget once the batch's
    entries are acknowledged."""

    envelopes: list[Envelope]
    minted: list[str]


class Intake:
    def __init__(self, conn: Connection, store: MessageStore, stream: str | None = None) -> None:
        self.conn = conn
        self.store = store
        self.keys = conn.keys
        self.settings = conn.settings
        self.stream = stream or conn.keys.ingress  # one partition of the ingress
        self._id_key: bytes | None = None

    async def take(self, entries: Sequence[RawEntry], *, recovering: bool) -> Intaken:
        """Decode and validate a batch, and name what its envelope does not (only those: a
        derived id is a keyed hash, 23 µs a message at 200 msg/s, on the way to the
        acceptance); the refused are rejected here, at once."""
        parsed = [parse_ingress(entry_id, flat) for entry_id, flat in entries]
        judged = [(item, self._judge(item)) for item in parsed]
        unnamed = [i.entry_id for i, o in judged if not isinstance(o, Envelope) or o.id is None]
        names, minted = await self.names(unnamed, recovering=recovering)
        envelopes = [_named(o, names.get(i.entry_id)) for i, o in judged if isinstance(o, Envelope)]
        await self.reject(
            [
                self.rejection(i.entry_id, names[i.entry_id], o.reason, o.raw, salvage=o.salvage)
                for i, o in judged
                if isinstance(o, Refusal)
            ],
            named_here=frozenset(e.message_id for e in envelopes),
        )
        return Intaken(envelopes, minted)

    async def acknowledge(
        self, entry_ids: Sequence[str], minted: Sequence[str], *, after: Sequence[Command] = ()
    ) -> None:
        """The batch is done: acknowledge its entries and forget the ids minted for them, in
        the round trip that carries ``after``: writes nothing waits on (counters)."""
        commands: list[Command] = [*after, ("XACK", self.stream, DISPATCH_GROUP, *entry_ids)]
        commands += [("DEL", name) for name in minted]  # each its own slot on a cluster
        await self.store.conn.run_all(commands)

    def rejection(
        self, entry_id: str, name: str, reason: str, raw: bytes, *, salvage: bytes | None = None
    ) -> Rejection:
        """What refusing an entry needs: the id and ``reply_to`` salvaged from its bytes (or
        from ``salvage``, the envelope among an entry's other fields)."""
        source = raw if salvage is None else salvage
        return Rejection(
            message_id=salvage_id(source) or name,
            reason=reason,
            raw=raw,
            reply_to=salvage_reply_to(source, self.keys.reply_prefix) or "",
            source=f"{self.stream} {entry_id}",
        )

    # -- naming --------------------------------------------------------------------------

    async def names(
        self, entry_ids: list[str], *, recovering: bool
    ) -> tuple[dict[str, str], list[str]]:
        """The message id each entry names when its envelope has none; and the keys of the
        minted ones. One round trip, and only when some entry is ahead of the clock (or the
        batch is handled again: an entry may have been ahead at its first handling)."""
        secret = await self.id_key()
        now = now_ms()
        ttl_ms = self.settings.record_ttl_s * 1000
        names: dict[str, str] = {}
        commands: list[Command] = []
        asked: list[tuple[str, str]] = []  # entry id, key: answered by each GET
        for entry_id in entry_ids:
            derived = entry_message_id(self.stream, entry_id, now_ms=now, key=secret)
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

    async def id_key(self) -> bytes:
        """The broker's key for ids derived from entries: made by the first dispatcher ever
        (``SET NX``), the same for all of them after."""
        if self._id_key is None:
            made = secrets.token_hex(32)
            _, value = await self._run(
                [("SET", self.keys.id_key, made, "NX"), ("GET", self.keys.id_key)]
            )
            self._id_key = bytes(value)
        return self._id_key

    async def _run(self, commands: list[Command]) -> list[Any]:
        replies = await self.conn.call_many(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    # -- judging -------------------------------------------------------------------------

    def _judge(self, item: IngressEntry | MalformedEntry) -> Envelope | Refusal:
        """The entry's envelope, its id as the producer gave it (perhaps none), or why not."""
        if isinstance(item, MalformedEntry):
            return Refusal(item.reason, item.raw, item.envelope)
        try:
            return self._decode(item.envelope)
        except InvalidEnvelope as exc:
            return Refusal(exc.reason, exc.raw)

    def _decode(self, raw: bytes) -> Envelope:
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
        # a name the entry gives (a ULID) always fits a broadcast: only the producer's may not
        if envelope.mode == "broadcast" and envelope.id and (problem := id_problem(envelope.id)):
            raise InvalidEnvelope(problem, raw)
        return envelope

    # -- refusing ------------------------------------------------------------------------

    async def reject(
        self, rejections: Sequence[Rejection], *, named_here: frozenset[str] = frozenset()
    ) -> None:
        """Record each as REJECTED (once per id), dead-letter its bytes, tell its producer
        where it left a usable ``reply_to``: a few round trips for the lot. Handled again
        (a restart mid-batch), an entry is told again — at least once; an id that already
        names another message is left as it is, and the refusal says so. So is an id a valid
        envelope of the same batch names (``named_here``): that message is accepted after
        this, and a refusal recorded first under its id would answer its producer."""
        if not rejections:
            return
        max_bytes = self.settings.dlq_entry_max_bytes
        own = [r for r in rejections if r.message_id not in named_here]
        records_made = [self._rejected_record(r, max_bytes) for r in own]
        made = iter(await self.store.try_accept_many(records_made) if own else [])
        accepted = [None if r.message_id in named_here else next(made) for r in rejections]
        # a record Redis refused (its key spoiled: anyone who may write records can) is said
        # in the refusal, which is told and dead-lettered all the same
        unwritten = {
            r.message_id: a
            for r, a in zip(rejections, accepted, strict=True)
            if isinstance(a, RedisReplyError)
        }
        taken = [
            r.message_id
            for r, a in zip(rejections, accepted, strict=True)
            if isinstance(a, Accepted) and not a.created
        ]
        records = dict(zip(taken, await self.store.get_records(taken), strict=True))
        owners: list[str] = []
        commands: list[Command] = []
        for r, a in zip(rejections, accepted, strict=True):
            reason = r.reason
            # the id names another message: what is said about this entry must not read as
            # that message's answer (a notice, not an outcome)
            foreign = a is None or (
                isinstance(a, Accepted)
                and not a.created
                and not _ours(records.get(r.message_id), r.raw, max_bytes)
            )
            if foreign:
                reason = f"{reason}; id {r.message_id} already names another message"
            elif r.message_id in unwritten:
                reason = f"{reason}; its record could not be written: {unwritten[r.message_id]}"
            lettered = dead_letter_commands(self.store.conn, self._letter(r, reason))
            commands += lettered
            owners += [r.message_id] * len(lettered)
            if r.reply_to:
                notice = REJECTED_NOTICE if foreign else None
                for command in self._answer(r.reply_to, r.message_id, reason, notice=notice):
                    commands.append(command)
                    owners.append(r.message_id)
            log.info("message %s rejected: %s", r.message_id, reason)
        await self.store.delivery.after_delivery(
            owners, commands, await self.conn.call_many(commands)
        )

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
            # an invalid envelope holds no id: a valid one under it takes it (accept.lua)
            fields={"invalid": "1", **({"envelope_size": str(size)} if size is not None else {})},
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

    def _answer(
        self,
        reply_to: str,
        message_id: str,
        error: str,
        *,
        notice: str | None = None,
        request: str | None = None,
    ) -> list[Command]:
        entry = ReplyEntry(
            id=message_id, stage=Stage.REJECTED, error=error, notice=notice, request=request
        )
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
        commands = dead_letter_commands(self.store.conn, letter)
        if planned.reply_to:
            # a notice naming the refused request: only its own producer takes it as its
            # answer, never one waiting for the message that holds the id
            commands += self._answer(
                planned.reply_to,
                record.id,
                reason,
                notice=ID_CONFLICT,
                request=request_digest(planned),
            )
        owners = [record.id] * len(commands)
        await self.store.delivery.after_delivery(
            owners, commands, await self.conn.call_many(commands)
        )
        log.warning("message %s: %s", record.id, reason)


def _ours(record: MessageRecord | None, raw: bytes, max_bytes: int) -> bool:
    """Whether an existing record is this very rejection, written by an earlier handling."""
    return (
        record is not None
        and record.stage is Stage.REJECTED
        and record.envelope == cap_bytes(raw, max_bytes)[0]
    )


def _named(envelope: Envelope, name: str | None) -> Envelope:
    """``envelope`` under its entry's ``name`` when it names no message itself."""
    if envelope.id is None:
        assert name is not None, "an envelope without an id was not named"
        envelope = msgspec.structs.replace(envelope, id=name)
    return complete(envelope)
