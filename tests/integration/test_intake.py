"""A sidecar's intake writes RECEIVED and PROCESSING for freshly read work in one round trip;
the fences keep that as safe as two. An assignment written twice to an instance's stream runs
once, and its copy is dead-lettered instead of being judged a crash's leftover."""

from __future__ import annotations

from broker.connection import Connection
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import dead_letters, eventually, routed_to, running_sidecar

# Both entries land in one call: the sidecar's blocked read wakes to find the two together.
TWICE = (
    "redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'attempt', '1') "
    "redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'attempt', '1')"
)


async def test_an_assignment_delivered_twice_in_one_batch_runs_once(conn: Connection) -> None:
    store = MessageStore(conn)
    queue = conn.keys.queue("a-1")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        message_id = await routed_to(conn, "a-1")
        await conn.call("EVAL", TWICE, 1, queue, message_id)

        async def settled() -> bool:
            record = await store.get_record(message_id)
            pending = (await conn.call("XPENDING", queue, "sidecar"))[0]
            return record is not None and record.stage is Stage.SUCCEEDED and pending == 0

        await eventually(settled, timeout_s=20)

    assert agent.log.calls[message_id] == 1
    stages = [str(e.stage) for e in await store.get_timeline(message_id)]
    assert stages == ["ACCEPTED", "ROUTED", "RECEIVED", "PROCESSING", "SUCCEEDED"]
    (letter,) = await dead_letters(conn)  # the copy: said so, acknowledged, never run
    assert f"{message_id} attempt 1 is taken" in letter["reason"].decode()
