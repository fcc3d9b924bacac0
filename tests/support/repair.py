"""For repair tests: records put in a given stage, agents whose outcome is unknown, and an
instance saturated on demand.

A record is accepted and walked through the lifecycle's real moves (ROUTED -> RECEIVED ->
PROCESSING -> the stage), as a sidecar would write them, without an agent: the stages an
operator repairs (NEEDS_CONFIRMATION, DEAD) take a crash or many failures to reach for real.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from broker.client import Client
from broker.connection import Connection
from broker.deadletters import Letter
from broker.due_clock import due_command
from broker.envelope import Envelope, complete, encode_envelope
from broker.keyspace import due_for
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.timekeeping import now_ms

from .agents import Behaviour, Gate, RunningAgent, http_agent
from .harness import eventually, running_dispatcher, running_sidecar

_WALK = (Stage.RECEIVED, Stage.PROCESSING)
_ENDED_WITH_ERROR = (Stage.FAILED, Stage.EXPIRED, Stage.CANCELLED)


def echo(reply_to: str = "", capability: str = "text.echo") -> Envelope:
    return msgspec.convert({"capability": capability, "reply_to": reply_to or None}, Envelope)


async def record_in(
    conn: Connection,
    stage: Stage,
    *,
    capability: str = "text.echo",
    reply_to: str = "",
    instance: str = "gone-1",
    reason: str = "",
) -> str:
    """A new message in ``stage`` (one reached through PROCESSING), indexed in ``P:due`` as
    the dispatcher indexes every accepted message. ``reason`` is the last step's; a FAILED
    one has it as its error too, and a DEAD one is also dead-lettered with it."""
    envelope = complete(echo(reply_to, capability))
    store = MessageStore(conn)
    now = now_ms()
    deadline = now + int(envelope.timeout_s * 1000)
    await store.accept(
        Acceptance(
            envelope.message_id,
            encode_envelope(envelope),
            capability,
            deadline_ms=deadline,
            reply_to=reply_to,
            priority=envelope.priority,
            next_stage=Stage.ROUTED,
            accepted_ms=now,
            instance=instance,
        )
    )
    await conn.call(*due_command(store.keys, envelope.message_id, deadline))
    if stage in (Stage.EXPIRED, Stage.CANCELLED):  # ended before any agent was asked
        walk: tuple[Stage, ...] = (stage,)
    elif stage in _WALK:
        walk = _WALK[: _WALK.index(stage) + 1]
    else:
        walk = (*_WALK, stage)
    for step in walk:
        last = step is stage
        moved = await store.move(
            envelope.message_id,
            step,
            reason=reason if last else "",
            fields={"error": reason} if last and stage in _ENDED_WITH_ERROR else None,
        )
        assert moved.ok, (step, moved)
    if stage is Stage.DEAD:
        await store.delivery.dead_letter(
            Letter(
                id=envelope.message_id,
                stage=Stage.DEAD.value,
                reason=reason,
                raw=encode_envelope(envelope),
                ts_ms=now_ms(),
            )
        )
    return envelope.message_id


async def stage_of(conn: Connection, message_id: str) -> Stage | None:
    record = await MessageStore(conn).get_record(message_id)
    return None if record is None else record.stage


async def reaches(conn: Connection, message_id: str, stage: Stage) -> None:
    """Wait (with a deadline) until the message's record is in ``stage``."""

    async def there() -> bool:
        return await stage_of(conn, message_id) is stage

    try:
        await eventually(there)
    except TimeoutError:
        timeline = await MessageStore(conn).get_timeline(message_id)
        raise AssertionError(f"{message_id} never reached {stage}: {timeline}") from None


async def everything(conn: Connection) -> dict[bytes, bytes]:
    """Every key of the test's prefix with its serialized value: equal before and after, a
    command changed nothing."""
    keys = sorted(await conn.call("KEYS", f"{conn.keys.prefix}:*"))
    return {key: await conn.call("DUMP", key) for key in keys}


def _unsure_once() -> Behaviour:
    """An agent that answers each message's first call with a bare 503 — ambiguous: a proxy
    may say so after the agent acted, so a non-idempotent instance parks the message as
    NEEDS_CONFIRMATION — and answers normally after that."""
    calls: dict[str, int] = {}

    async def behave(envelope: dict[str, Any], request: Request) -> Response | None:
        message_id = request.headers["x-reach-message-id"]
        calls[message_id] = calls.get(message_id, 0) + 1
        return Response(status_code=503) if calls[message_id] == 1 else None

    return behave


@dataclass
class Saturated:
    """One instance ``a-1`` of ``text.echo`` with a single credit, its agent's calls held at
    ``gate``: the first message submitted stays PROCESSING, the ones after it WAITING."""

    conn: Connection
    agent: RunningAgent
    gate: Gate
    client: Client

    async def busy(self, reply_to: str = "") -> str:
        message_id = await self.client.submit(echo(reply_to))
        await reaches(self.conn, message_id, Stage.PROCESSING)
        return message_id

    async def queued(self, reply_to: str = "") -> str:
        """A message WAITING and indexed. A record accepted WAITING gets its deadline entry
        and its place in the waiting set in the round trip after it is created, and the
        operator's listings read that index: until then they do not see it yet."""
        message_id = await self.client.submit(echo(reply_to))
        await reaches(self.conn, message_id, Stage.WAITING)
        due = due_for(self.conn.keys, message_id)

        async def indexed() -> bool:
            return await self.conn.call("ZSCORE", due, message_id) is not None

        await eventually(indexed)
        return message_id


@asynccontextmanager
async def saturated(conn: Connection) -> AsyncIterator[Saturated]:
    """A :class:`Saturated` instance with a dispatcher; the gate opens on the way out."""
    gate = Gate()
    async with (
        http_agent("a", behaviour=gate) as agent,
        running_sidecar(
            conn, "a-1", ("text.echo",), url=agent.url, max_inflight=1, adaptive_credits=False
        ),
        running_dispatcher(conn),
    ):
        try:
            yield Saturated(conn, agent, gate, Client(conn))
        finally:
            gate.open()


@dataclass
class Unsure:
    """Two non-idempotent instances, ``a-1`` and ``a-2``, of one agent that answers each
    message's first call with a bare 503: a message submitted parks as NEEDS_CONFIRMATION,
    and runs to success when replayed. Two, because a 503 counts against the instance's
    health: with no other traffic in its window it is DOWN for a while, so the replay runs
    on its healthy peer."""

    conn: Connection
    agent: RunningAgent
    client: Client
    reply_to: str

    async def parked(self) -> str:
        message_id = await self.client.submit(echo(self.reply_to))
        await reaches(self.conn, message_id, Stage.NEEDS_CONFIRMATION)
        return message_id


@asynccontextmanager
async def unsure(conn: Connection) -> AsyncIterator[Unsure]:
    """An :class:`Unsure` pair of instances with a dispatcher."""
    async with (
        http_agent("a", behaviour=_unsure_once()) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_sidecar(conn, "a-2", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        client = Client(conn)
        yield Unsure(conn, agent, client, client.new_reply_stream())
