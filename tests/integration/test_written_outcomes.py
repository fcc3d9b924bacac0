"""Outcomes the sidecar writes at once (a requeue, a retry, DEAD) while Redis is away:
kept and written when it is back, not left pending for a resumption that no longer knows them.

Each test runs on a redis-server of its own, stopped under the sidecar while a call is held,
and started again on its port (its data back from the AOF) after the call has ended.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import Response

from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.envelope import Envelope
from broker.errors import RedisUnavailable, first_leaf
from broker.records import TimelineEntry
from broker.stages import PARKED, TERMINAL, Stage
from broker.store import MessageStore
from broker.streams import fields_of
from tests.conftest import suite_redis_binary
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import card as harness_card
from tests.support.harness import eventually, running_dispatcher


class AnswersFirstWhenReleased:
    """Holds the first call until released, then gives ``answer``; every later call is
    answered with a result."""

    def __init__(self, answer: Response) -> None:
        self.answer = answer
        self.release = anyio.Event()
        self.seen = 0

    async def __call__(self, envelope: dict[str, Any], request: Request) -> Response | None:
        self.seen += 1
        if self.seen > 1:
            return None
        await self.release.wait()
        return self.answer


@dataclass
class Outage:
    conn: Connection
    sidecar: Sidecar
    agent: RunningAgent
    message_id: str
    reply_to: str


REFUSAL = Response(status_code=429, headers={"Retry-After": "0"})  # it did not take the work


@asynccontextmanager
async def answered_while_redis_is_away(
    settings: Settings,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    *,
    answer: Response = REFUSAL,
    stop: bool = False,
    idempotent: bool = False,
    max_attempts: int = 3,
    grace_s: float = 30.0,
    back: bool = True,
) -> AsyncIterator[Outage]:
    """One message to an agent that gives ``answer`` while Redis is stopped (the sidecar
    stopped too, with ``stop``, and a grace of ``grace_s``); Redis is started again when the
    write has failed (unless not ``back``)."""
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    behaviour = AnswersFirstWhenReleased(answer)
    try:
        async with (
            open_connection(own, server.url) as conn,
            http_agent("refusing", behaviour=behaviour) as agent,
            aclosing(HttpTransport(agent.url, timeout_s=30, max_connections=2)) as transport,
            anyio.create_task_group() as tg,
        ):
            client = Client(conn)
            card = harness_card("r-1", ("text.echo",), idempotent=idempotent)
            sidecar = Sidecar(conn, card, transport, grace_s=grace_s)
            await tg.start(sidecar.run)
            async with running_dispatcher(conn, reaper=False):
                reply_to = client.new_reply_stream()
                raw = msgspec.json.encode(
                    {
                        "capability": "text.echo",
                        "payload": {},
                        "max_attempts": max_attempts,
                        "reply_to": reply_to,
                    }
                )
                envelope = msgspec.json.decode(raw, type=Envelope)
                message_id = await client.submit(envelope)
                await eventually(lambda: _true(agent.log.concurrent == 1))
            with caplog.at_level(logging.WARNING, logger="agent_reach.sidecar"):
                server.stop()
                if stop:
                    sidecar.stop()
                behaviour.release.set()  # the answer comes while Redis is away

                async def write_failed() -> bool:
                    said = [r.getMessage() for r in caplog.records]
                    return any(message_id in m and "navailable" in m for m in said)

                await eventually(write_failed)
            if back:
                server = RedisServer.start(tmp_path / "redis", binary=binary, port=server.port)
            yield Outage(conn, sidecar, agent, message_id, reply_to)
            tg.cancel_scope.cancel()
    finally:
        server.stop()


async def _true(value: bool) -> bool:
    return value


async def settled(
    store: MessageStore, message_id: str, stages: frozenset[Stage]
) -> tuple[Stage, list[TimelineEntry]]:
    """The record's stage once it is one of ``stages``, and its timeline."""
    found: list[Stage] = []

    async def arrived() -> bool:
        record = await store.get_record(message_id)
        found[:] = [record.stage] if record is not None else []
        return record is not None and record.stage in stages

    await eventually(arrived)
    return found[0], await store.get_timeline(message_id)


@pytest.mark.timeout(90)
async def test_a_refusal_while_redis_is_away_is_requeued_when_it_is_back(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-idempotent agent answers 429 while Redis is away: the requeue waits for Redis,
    and the message runs once more and succeeds — not parked as "may have run"."""
    async with answered_while_redis_is_away(settings, tmp_path, caplog) as o:
        async with running_dispatcher(o.conn, reaper=False):
            stage, timeline = await settled(
                MessageStore(o.conn), o.message_id, TERMINAL | {Stage.NEEDS_CONFIRMATION}
            )
    assert stage is Stage.SUCCEEDED, timeline[-1]
    assert o.agent.log.calls[o.message_id] == 2  # refused once, then run once
    assert any("429" in entry.reason for entry in timeline)


@pytest.mark.timeout(90)
async def test_a_refusal_while_a_stopping_sidecar_waits_for_redis_is_requeued(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar is stopped too (a failover often brings a fleet's restart): the requeue is
    written within its grace, the sidecar leaves, and the message waits for an instance."""
    async with answered_while_redis_is_away(settings, tmp_path, caplog, stop=True) as o:
        with anyio.fail_after(30):
            await o.sidecar.stopped.wait()
        stage, timeline = await settled(MessageStore(o.conn), o.message_id, TERMINAL | PARKED)
        card = await o.conn.call("EXISTS", o.conn.keys.card("r-1"))
    assert stage is Stage.WAITING, timeline[-1]
    assert "429" in timeline[-1].reason
    assert o.agent.log.calls[o.message_id] == 1
    assert card == 0  # deregistered


@pytest.mark.timeout(90)
async def test_a_last_attempt_ended_dead_while_redis_is_away_is_lettered_and_told_once(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An idempotent agent's answer proves nothing (a bare 503) on the last attempt: DEAD. The
    move waits for Redis; then the message is dead-lettered once, its producer told once,
    and its ``reply_pending`` mark gone — not run again as a restart would have it."""
    busy = Response(status_code=503)
    async with answered_while_redis_is_away(
        settings, tmp_path, caplog, answer=busy, idempotent=True, max_attempts=1
    ) as o:
        store = MessageStore(o.conn)
        stage, _ = await settled(store, o.message_id, TERMINAL | PARKED)

        record_key = o.conn.keys.record(o.message_id)

        async def told() -> bool:
            told = await o.conn.call("XLEN", o.reply_to) == 1
            return told and not await o.conn.call("HEXISTS", record_key, "reply_pending")

        await eventually(told)
        letters = await o.conn.call("XRANGE", o.conn.keys.dlq, "-", "+")
        replies = await o.conn.call("XLEN", o.reply_to)
    assert stage is Stage.DEAD
    assert o.agent.log.calls[o.message_id] == 1  # not run again
    assert [fields_of(f).get("id") for _, f in letters] == [o.message_id.encode()]
    assert replies == 1


@pytest.mark.timeout(60)
async def test_a_write_waiting_for_redis_does_not_hold_a_stop_past_its_grace(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stays away: the requeue waiting for it is given up at the stop's deadline, and
    the stop ends with the error (its entry stays pending for the reaper), not never."""
    with pytest.raises(BaseExceptionGroup) as raised:
        async with answered_while_redis_is_away(
            settings, tmp_path, caplog, stop=True, grace_s=1.0, back=False
        ) as o:
            with anyio.fail_after(15):
                await o.sidecar.stopped.wait()  # never set: the stop ends with the error
    assert isinstance(first_leaf(raised.value), RedisUnavailable)
    assert not o.sidecar.stopped.is_set()
