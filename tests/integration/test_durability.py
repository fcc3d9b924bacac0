"""``replica_acks`` against a real master and replica (broker/durability.py): a write is
answered once the replica has it; without a replica in sync it is unavailable, with the
reason, and reads go on."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.config import build_settings
from broker.connection import open_connection
from broker.embedded import RedisServer
from broker.errors import RedisUnavailable
from broker.stages import Stage
from broker.store import MessageStore
from tests.conftest import suite_redis_binary
from tests.support.agents import recording_agent
from tests.support.harness import eventually, routed_to, running_sidecar

TIMEOUT_S = 0.3


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    binary = suite_redis_binary()
    master = RedisServer.start(tmp_path / "master", binary=binary)
    replica = RedisServer.start(
        tmp_path / "replica",
        binary=binary,
        extra_args=["--replicaof", "127.0.0.1", str(master.port)],
    )
    try:
        yield master, replica
    finally:
        replica.kill()
        master.stop()


async def test_a_write_is_answered_once_the_replica_has_it(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    settings = build_settings(
        [{"redis_url": master.url, "replica_acks": 1, "replica_ack_timeout_s": 5.0}]
    )
    async with open_connection(settings, master.url) as conn:
        await conn.run_all([("SET", "a", "1"), ("XADD", "s", "*", "f", "v")])
        # answered only after the replica acknowledged: it has the writes now, no polling
        seen = redis.Redis(port=replica.port)
        assert seen.get("a") == b"1" and seen.xlen("s") == 1


async def test_without_a_replica_writes_are_unavailable_with_the_reason_and_reads_go_on(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    replica.kill()
    settings = build_settings(
        [{"redis_url": master.url, "replica_acks": 1, "replica_ack_timeout_s": TIMEOUT_S}]
    )
    async with open_connection(settings, master.url) as conn:
        with pytest.raises(RedisUnavailable, match=r"replica_acks = 1, but 0 replica\(s\)"):
            await conn.call("SET", "k", "v")
        # the write itself happened on the master (retried callers are idempotent); reads
        # wait for nothing
        assert await conn.call("GET", "k") == b"v"
        assert await conn.call_many([("EXISTS", "k"), ("XLEN", "s")]) == [1, 0]


async def test_replica_acks_0_is_todays_behaviour(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    replica.kill()
    settings = build_settings([{"redis_url": master.url}])
    async with open_connection(settings, master.url) as conn:
        assert await conn.call("SET", "k", "v") == b"OK"


async def test_a_sidecar_calls_its_agent_only_once_a_replica_has_processing(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """With ``replica_acks``, the sidecar takes its work the way whose writes wait for the
    replica: while the replica is stopped, taking fails and the agent is not called. The
    PROCESSING it wrote was never answered, so never followed by a call: once the replica
    is back, the sidecar writes PROCESSING again, this time held by the replica, and calls
    the (non-idempotent) agent once — the message is not parked as a crash's leftover."""
    master, replica = pair
    settings = build_settings(
        [{"redis_url": master.url, "replica_acks": 1, "replica_ack_timeout_s": 2.0}]
    )
    agent, calls = recording_agent("f")
    async with open_connection(settings, master.url) as conn:
        message_id = await routed_to(conn, "f-1")
        async with running_sidecar(conn, "f-1", ("text.echo",), transport=agent):
            replica.process.send_signal(signal.SIGSTOP)
            try:
                # the assignment, written past the broker's own writes (they wait for acks)
                plain = redis.Redis(port=master.port)
                plain.xadd(conn.keys.queue("f-1"), {"id": message_id, "attempt": "1"})

                async def refused() -> bool:
                    return any(
                        "read failed" in r.getMessage() and "replica" in r.getMessage()
                        for r in caplog.records
                    )

                await eventually(refused)
                assert calls == []
            finally:
                replica.process.send_signal(signal.SIGCONT)

            async def succeeded() -> bool:
                stages = await MessageStore(conn).stages([message_id])
                assert stages != [Stage.NEEDS_CONFIRMATION]
                return stages == [Stage.SUCCEEDED]

            await eventually(succeeded)
    assert calls == [message_id]
