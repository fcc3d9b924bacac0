"""Outcomes the sidecar writes at once (a requeue, a retry, a dead letter) while Redis is away:
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
from broker.records import TimelineEntry
from broker.stages import PARKED, TERMINAL, Stage
from broker.store import MessageStore
from tests.conftest import suite_redis_binary
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import card as harness_card
from tests.support.harness import eventually, running_dispatcher


class RefusesFirstWhenReleased:
    """Holds the first call until released, then refuses it (429: the agent did not take the
    work); every later call is answered."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.seen = 0

    async def __call__(self, envelope: dict[str, Any], request: Request) -> Response | None:
        self.seen += 1
        if self.seen > 1:
            return None
        await self.release.wait()
        return Response(status_code=429, headers={"Retry-After": "0"})


@dataclass
class Outage:
    conn: Connection
    sidecar: Sidecar
    agent: RunningAgent
    message_id: str


@asynccontextmanager
async def refused_while_redis_is_away(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture, *, stop: bool
) -> AsyncIterator[Outage]:
    """One message to a non-idempotent agent that refuses it while Redis is stopped (the
    sidecar stopped too, with ``stop``); Redis is started again when the write has failed."""
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    behaviour = RefusesFirstWhenReleased()
    try:
        async with (
            open_connection(own, server.url) as conn,
            http_agent("refusing", behaviour=behaviour) as agent,
            aclosing(HttpTransport(agent.url, timeout_s=30, max_connections=2)) as transport,
            anyio.create_task_group() as tg,
        ):
            client = Client(conn)
            sidecar = Sidecar(conn, harness_card("r-1", ("text.echo",)), transport, grace_s=30)
            await tg.start(sidecar.run)
            async with running_dispatcher(conn, reaper=False):
                raw = msgspec.json.encode({"capability": "text.echo", "payload": {"n": 1}})
                envelope = msgspec.json.decode(raw, type=Envelope)
                message_id = await client.submit(envelope)
                await eventually(lambda: _true(agent.log.concurrent == 1))
            with caplog.at_level(logging.WARNING, logger="agent_reach.sidecar"):
                server.stop()
                if stop:
                    sidecar.stop()
                behaviour.release.set()  # the refusal comes while Redis is away

                async def write_failed() -> bool:
                    said = [r.getMessage() for r in caplog.records]
                    return any(message_id in m and "navailable" in m for m in said)

                await eventually(write_failed)
            server = RedisServer.start(tmp_path / "redis", binary=binary, port=server.port)
            yield Outage(conn, sidecar, agent, message_id)
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
    async with refused_while_redis_is_away(settings, tmp_path, caplog, stop=False) as o:
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
    async with refused_while_redis_is_away(settings, tmp_path, caplog, stop=True) as o:
        with anyio.fail_after(30):
            await o.sidecar.stopped.wait()
        stage, timeline = await settled(MessageStore(o.conn), o.message_id, TERMINAL | PARKED)
        card = await o.conn.call("EXISTS", o.conn.keys.card("r-1"))
    assert stage is Stage.WAITING, timeline[-1]
    assert "429" in timeline[-1].reason
    assert o.agent.log.calls[o.message_id] == 1
    assert card == 0  # deregistered
