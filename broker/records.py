"""Typed views of what Redis holds: message records, timeline entries, instance cards.

Redis hands back ``bytes``; these are the only shapes the rest of the code sees.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Annotated

import msgspec

from .envelope import MESSAGE_ID_PATTERN, stored_reply_to
from .stages import Stage


class InstanceState(StrEnum):
    UP = "UP"
    DEGRADED = "DEGRADED"
    DOWN = "DOWN"
    DRAINING = "DRAINING"


# Instance ids sit inside `{...}` hash tags: the message-id alphabet keeps braces out.
InstanceId = Annotated[str, msgspec.Meta(pattern=MESSAGE_ID_PATTERN)]


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# what a card may say of its agent in words (``--describe``, ``--example``)
MAX_DESCRIPTION_CHARS = 2000
MAX_EXAMPLES = 20
MAX_EXAMPLE_CHARS = 300


class InstanceCard(msgspec.Struct, frozen=True, kw_only=True):
    """What a sidecar registers for its agent instance."""

    agent_id: InstanceId
    instance_id: InstanceId
    capabilities: tuple[str, ...]
    endpoint: str
    max_inflight: int
    idempotent: bool = False
    version: str = "0"
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    weight: float = 1.0
    cost: float = 0.0
    status_url: str = ""
    # what the agent does, in words: the intent router compares intents with these
    description: str = ""
    examples: tuple[str, ...] = ()
    # the instance's rate limit (agent-reach sidecar --rate/--burst): ms per call, 0 = none
    rate_ms: float = 0.0
    burst: int = 1


class InstanceStats(msgspec.Struct, frozen=True, kw_only=True):
    """Live figures a sidecar measures over its sliding window and sends with each heartbeat."""

    error_rate: float = 0.0
    p95_ms: float = 0.0
    requests: int = 0  # in the window
    successes: int = 0  # since start: the cold-start confidence counts these
    cooldown_until_ms: int = 0
    circuit: CircuitState = CircuitState.CLOSED
    circuit_until_ms: int = 0
    backoff_until_ms: int = 0  # the agent answered 429/503 with Retry-After: not before this


class InstanceView(msgspec.Struct, frozen=True, kw_only=True):
    """An instance as the registry sees it now: card, state, credits, heartbeat and stats.

    ``weight`` is the card's current weight (``agent-reach weight`` changes it at run time)."""

    card: InstanceCard
    state: InstanceState
    credits: int
    inflight: int
    heartbeat_ms: int
    stats: InstanceStats = msgspec.field(default_factory=InstanceStats)

    @property
    def instance_id(self) -> str:
        return self.card.instance_id

    @property
    def free_credits(self) -> int:
        return max(0, self.credits - self.inflight)


class TimelineEntry(msgspec.Struct, frozen=True):
    """One step of a message's life: a stage it entered, or an event that changed no stage
    (``CALLBACK_DELIVERED``: its result reached the producer's webhook)."""

    ts_ms: int
    stage: Stage | str  # a Stage, or the name of an event
    instance: str
    attempt: int
    reason: str


def taken_over_mark(attempt: int, instance: str) -> str:
    """The record field ``taken_over`` once the reaper has acknowledged the entry of this
    attempt on this instance for its dead sidecar: nobody else will return its credit."""
    return f"{attempt}@{instance}"


class MessageRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    stage: Stage
    attempt: int
    instance: str
    capability: str
    envelope: bytes
    accepted_ms: int
    deadline_ms: int
    updated_ms: int
    kept_reply_to: str  # the record's own reply_to field ("" for most: see reply_to)
    priority: int
    result: bytes | None = None
    error: str | None = None
    route_reason: str | None = None
    route_from: bytes | None = None  # JSON: the funnel, step by step
    avoid: str = ""  # the instance that failed the last attempt: a retry goes elsewhere
    retry_at_ms: int = 0  # a retry waits out its back-off until then (the reaper parks it)
    extensions: int = 0  # times the reaper let a PROCESSING message run on ("running")
    reply_pending: bool = False  # ended by the reaper, the producer not yet told
    awaiting_callback: bool = False  # an async agent took it (202) and will call back
    agent_task: str = ""  # the async agent's own id for the work, when it gave one
    usage: bytes | None = None  # what the agent reported for this attempt (usage:<attempt>)
    # the token of the sidecar's round trip that last wrote PROCESSING before a call
    # (adapters/holdings.py); "" on records older than it
    take_call: str = ""
    # "<attempt>@<instance>": the reaper acknowledged that attempt's entry for a dead
    # sidecar (workers/takeover.py), so the credit is the reaper's to return, also once the
    # instance lives again (workers/resolver.py, Resolver.release)
    taken_over: str = ""

    @property
    def credit_taken_over(self) -> bool:
        """Whether the reaper holds this attempt's credit (:func:`taken_over_mark`)."""
        return self.taken_over == taken_over_mark(self.attempt, self.instance)

    @property
    def reply_to(self) -> str:
        """Where the producer is told. An accepted envelope's reply_to is not copied into
        the record (``broker.store.Acceptance``): it is read from the envelope, only when
        asked. A REJECTED record keeps its own, and never lends its envelope's (an invalid
        one's is unchecked)."""
        if self.kept_reply_to or self.stage is Stage.REJECTED:
            return self.kept_reply_to
        return stored_reply_to(self.envelope)


class AssignResult(IntEnum):
    """The answers of ``lua/assign.lua``."""

    ASSIGNED = 1
    ALREADY_ASSIGNED = 2
    NO_CREDIT = 0
    UNKNOWN_INSTANCE = -1
    NOT_ACCEPTING = -2
    HEARTBEAT_LAPSED = -3
    RATE_LIMITED = -4


class Accepted(msgspec.Struct, frozen=True):
    """The answer of ``lua/accept.lua``: whether this call created the record, and its stage;
    of ``lua/accept_assign.lua`` also the assignment's answer (``None``: none was tried)."""

    created: bool
    stage: Stage
    attempt: int
    assigned: AssignResult | None = None


class Moved(msgspec.Struct, frozen=True):
    """The answer of a compare-and-set: ``ok`` and the record's stage after the call."""

    ok: bool
    stage: Stage | None
    attempt: int
    instance: str
    value: bytes | None = None
    accepted_ms: int = 0  # on success: when the broker accepted the message (for timings)
    assigned: AssignResult | None = None  # lua/claim_assign.lua: the assignment's answer

    @property
    def missing(self) -> bool:
        return self.stage is None

    @property
    def key(self) -> tuple[Stage | None, int, str]:
        """Where the record is: its stage, attempt and instance (what a move is fenced on)."""
        return (self.stage, self.attempt, self.instance)
