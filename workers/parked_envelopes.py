"""The envelopes a dispatcher parked itself, kept so its drain need not read them back.

Under a backlog every message is parked when it arrives and drained when a credit frees, and
reading each waiting record back (``HGETALL``: the envelope, the timeline, the route) and
decoding it was a fifth of the dispatcher's work a message (``bench.cpu_cost --burst``). The
dispatcher that parked a message has just decoded its envelope, and an envelope never
changes once accepted. What else the drain reads of a waiting record — its stage, attempt,
``avoid``, ``retry_at_ms`` — is as acceptance wrote it until the record's first move, and
every move writes ``updated_ms``. So a claim made from a kept envelope is fenced on the record
having no ``updated_ms`` (:data:`UNMOVED`): one that moved since (claimed by another
dispatcher and sent back, retried, expired, replayed) refuses the claim, and the next drain
reads the record as it does any other.

Bounded by count, bytes and age: past the bounds a park is not kept (the oldest are those a
drain reaches first), and an entry older than :data:`KEEP_S` goes (another dispatcher may
have assigned it: this one would never meet it again). Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.envelope import Envelope
from broker.records import MessageRecord
from broker.stages import Stage

# The fence of a claim from a kept envelope: the record has never moved since acceptance.
UNMOVED = ("updated_ms", "")
KEEP_S = 60.0
MAX_KEPT = 10_000
MAX_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Kept:
    capability: str
    envelope: Envelope
    accepted_ms: int
    size: int

    def record(self) -> MessageRecord:
        """The record as acceptance wrote it: WAITING, never attempted."""
        e = self.envelope
        return MessageRecord(
            id=e.message_id,
            stage=Stage.WAITING,
            attempt=0,
            instance="",
            capability=self.capability,
            envelope=b"",  # not read: the drain takes the envelope itself
            accepted_ms=self.accepted_ms,
            deadline_ms=0,
            updated_ms=0,
            kept_reply_to="",
            priority=e.priority,
        )


class ParkedEnvelopes:
    def __init__(
        self, *, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT, max_bytes: int = MAX_BYTES
    ) -> None:
        self.keep_ms = int(keep_s * 1000)
        self.max_kept = max_kept
        self.max_bytes = max_bytes
        self._kept: dict[str, Kept] = {}  # in the order parked: the oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, capability: str, envelope: Envelope, accepted_ms: int, size: int) -> None:
        """A message this dispatcher accepted straight into WAITING; ``size``: its envelope's
        bytes. Not kept past the bounds."""
        self.expire(accepted_ms)
        self.drop(envelope.message_id)  # an earlier envelope under this id: never its drain's
        if len(self._kept) >= self.max_kept or self._bytes + size > self.max_bytes:
            return
        self._kept[envelope.message_id] = Kept(capability, envelope, accepted_ms, size)
        self._bytes += size

    def get(self, message_id: str) -> Kept | None:
        return self._kept.get(message_id)

    def drop(self, message_id: str) -> None:
        """A claim was tried from it: won or refused, the record has moved on or must be read."""
        if (kept := self._kept.pop(message_id, None)) is not None:
            self._bytes -= kept.size

    def expire(self, now_ms: int) -> None:
        """Let go of what was parked more than ``keep_s`` ago."""
        while self._kept:
            message_id, kept = next(iter(self._kept.items()))
            if now_ms - kept.accepted_ms <= self.keep_ms:
                return
            self.drop(message_id)
