"""A sidecar's intake on a real server: what it takes starts before it reads again; any
instance id the card allows reads its stream; a read whose answer is lost costs no message
a call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec
import pytest

from adapters.http import HttpAsyncTransport
from adapters.python import Agent
from adapters.runner import NEVER_CALLED
from adapters.sidecar import Sidecar
from adapters.transport import Transport
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.ids import new_message_id
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import recording_agent
from tests.support.harness import (
    collect_replies,
    connected,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from tests.support.partition import PartitionProxy, partition_proxy


async def test_a_taken_message_starts_before_the_next_read(conn: Connection) -> None:
    """The agent is called before the intake sends its next read: that read is a write and
    a wake-up the message would otherwise wait behind. The reads are counted as the intake
    issues them; the handler notes the count when it starts."""
    agent = Agent("order")
    reads_at_start: list[int] = []
    reads = {"issued": 0, "brought": 0}  # reads issued; the one that brought the message

    @agent.handler("order.check")
    async def check(envelope: Envelope) -> dict[str, Any]:
        reads_at_start.append(reads["issued"])
        return {}

    reply_to = conn.keys.reply("order")
    async with (
        running_sidecar(conn, "order-1", ("order.check",), transport=agent) as sidecar,
        running_dispatcher(conn),
    ):
        count_reads(sidecar, reads)
        client = Client(conn)
        # the first message may come on a read already on its way: counted are the second's
        for sent in (1, 2):
            await client.submit(Envelope(capability="order.check", reply_to=reply_to))
            await collect_replies(conn, reply_to, sent)
    assert reads["brought"] > 0
    assert reads_at_start[-1] == reads["brought"]  # no read issued after it


async def test_an_instance_named_like_a_read_option_serves(conn: Connection) -> None:
    """``BLOCK`` is an instance id like any other (and the consumer name of its reads): a
    read's timeout is its block time as given, never looked up among the command's words."""
    agent = Agent("block")
    served: list[str] = []

    @agent.handler("order.check")
    async def check(envelope: Envelope) -> dict[str, Any]:
        served.append(envelope.message_id)
        return {}

    reply_to = conn.keys.reply("block")
    async with (
        running_sidecar(conn, "BLOCK", ("order.check",), transport=agent),
        running_dispatcher(conn),
    ):
        client = Client(conn)
        sent = [
            await client.submit(Envelope(capability="order.check", reply_to=reply_to))
            for _ in range(3)
        ]
        results = await collect_replies(conn, reply_to, 3, timeout_s=20)
    assert sorted(served) == sorted(sent)
    assert all(r.ok for r in results.values())


@pytest.mark.one_server  # the one-wake-up take (lua/take.lua): a single server's
async def test_a_take_whose_answer_is_lost_runs_its_message(
    conn: Connection, settings: Settings
) -> None:
    """A partition while the sidecar waits in its blocking read: Redis still holds the
    connection and runs the take script when an assignment comes (RECEIVED, PROCESSING),
    and its answer is lost. The sidecar gives up on the read within the processing grace,
    reads again, and finds the message PROCESSING: written by its own unanswered call, so
    never sent to the agent. It calls the (non-idempotent) agent once, and the message
    succeeds — before the reaper (here at the default call timeout: 5 s + 5 s after
    PROCESSING) would ask after it and park it as a crash's leftover."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    reply_to = conn.keys.reply("lost")
    async with sidecar_through_proxy(settings, agent, reply_to) as (proxy, client):
        # the take script's answer (it holds the envelope, with the id) is lost
        lost = new_message_id()
        proxy.lose_answer_with(lost.encode())
        # a deadline within the reaper's lateness (5 s + 5 s): it looks at 9 s, and parks
        # the message at 10 s unless its sidecar has run it by then
        await client.submit(
            Envelope(id=lost, capability="text.echo", reply_to=reply_to, timeout_s=9.0)
        )
        with anyio.fail_after(5):
            await proxy.cut.wait()
        await wait_for_stage(store, lost, Stage.PROCESSING, timeout_s=5)
        assert calls.count(lost) == 0
        record = await store.get_record(lost)
        assert record is not None and record.take_call
        # the read gives up (block + 5 s), and the message is found again
        await wait_for_stage(store, lost, Stage.SUCCEEDED, timeout_s=30)
    assert calls.count(lost) == 1
    reasons = [(e.stage, e.reason) for e in await store.get_timeline(lost)]
    assert (Stage.PROCESSING, NEVER_CALLED) in reasons, reasons
    assert Stage.NEEDS_CONFIRMATION not in [stage for stage, _ in reasons]


@pytest.mark.one_server  # the one-wake-up take (lua/take.lua): a single server's
async def test_a_take_that_reaches_redis_after_the_sidecar_read_again_runs_its_message(
    conn: Connection, settings: Settings
) -> None:
    """The other half of a partition: a take's write held on the way, until the sidecar
    gave up on it, read its pending list again (empty) and read on, on a new connection. Then
    it reaches Redis (on the old connection, which Redis kept) and takes a message: PROCESSING
    with the lost take's token, in the pending list, and no read of the sidecar's brings it
    back. The sidecar reads its pending list again for a while after a round trip went
    unanswered, finds it there, and calls the (non-idempotent) agent once — before the reaper
    (5 s + 5 s after PROCESSING) parks it."""
    agent, calls = recording_agent("f")
    store = MessageStore(conn)
    reply_to = conn.keys.reply("late")
    # the read gives up 1 s past its block
    async with sidecar_through_proxy(settings, agent, reply_to, grace_s=1.0) as (proxy, client):
        # the next take (its blocking XREAD), and the one after the sidecar gave up on it
        proxy.hold_writes_with(b"$5\r\nXREAD\r\n", 2)
        with anyio.fail_after(15):
            await proxy.all_held.wait()
        late = await client.submit(Envelope(capability="text.echo", reply_to=reply_to))
        queue = conn.keys.queue("f-1")

        async def assigned() -> bool:
            return int(await conn.call("XLEN", queue)) == 2

        await eventually(assigned, timeout_s=10)
        lost, live = proxy.held
        await lost.deliver()  # the old take reaches Redis, and takes the message
        await wait_for_stage(store, late, Stage.PROCESSING, timeout_s=5)
        assert calls.count(late) == 0  # the sidecar still waits for its live read's answer
        await live.deliver()  # the sidecar's read goes on: nothing new to take
        await wait_for_stage(store, late, Stage.SUCCEEDED, timeout_s=15)
    assert calls.count(late) == 1
    reasons = [(e.stage, e.reason) for e in await store.get_timeline(late)]
    assert (Stage.PROCESSING, NEVER_CALLED) in reasons, reasons


@asynccontextmanager
async def sidecar_through_proxy(
    settings: Settings, agent: Transport, reply_to: str, *, grace_s: float = 5.0
) -> AsyncIterator[tuple[PartitionProxy, Client]]:
    """A dispatcher and a reaper at the default call timeout (a PROCESSING message is asked
    after 5 s + 5 s after it was written), and a sidecar of instance ``f-1`` reaching Redis
    through a :class:`PartitionProxy`, with ``grace_s`` as its processing grace; a first
    message has run through them. Yields the proxy and a producer's client."""
    default_timeouts = msgspec.structs.replace(settings, sync_call_timeout_s=5.0)
    assert settings.redis_url is not None
    async with partition_proxy(urlsplit(settings.redis_url).port or 6379) as proxy:
        through = msgspec.structs.replace(
            default_timeouts, redis_url=proxy.url, processing_grace_s=grace_s
        )
        async with (
            connected(default_timeouts) as broker_conn,
            connected(through) as sidecar_conn,
            running_sidecar(sidecar_conn, "f-1", ("text.echo",), transport=agent),
            running_dispatcher(broker_conn),
        ):
            client = Client(broker_conn)
            warm = await client.submit(Envelope(capability="text.echo", reply_to=reply_to))
            await wait_for_stage(MessageStore(broker_conn), warm, Stage.SUCCEEDED)
            yield proxy, client


async def wait_for_stage(
    store: MessageStore, message_id: str, stage: Stage, *, timeout_s: float = 10
) -> None:
    """Until the record of ``message_id`` is in ``stage``; it must not end elsewhere."""
    with anyio.fail_after(timeout_s):
        while (now := (await store.stages([message_id]))[0]) is not stage:
            assert now not in (Stage.NEEDS_CONFIRMATION, Stage.FAILED, Stage.DEAD), now
            await anyio.sleep(0.02)


def count_reads(sidecar: Sidecar, reads: dict[str, int]) -> None:
    """Count the intake's reads as they are issued (before each goes out): a plain read, or
    a read that takes too (``take_next``); and note which one brought what was started."""
    intake = sidecar.intake
    read, take_next, start = intake.read, intake.take_next, intake._start

    async def counted_read(*args: Any, **kwargs: Any) -> Any:
        reads["issued"] += 1
        return await read(*args, **kwargs)

    async def counted_take_next(*args: Any, **kwargs: Any) -> Any:
        reads["issued"] += 1
        return await take_next(*args, **kwargs)

    async def noted_start(pool: Any, taken: list[Any], *args: Any) -> Any:
        if taken:
            reads["brought"] = reads["issued"]
        return await start(pool, taken, *args)

    intake.read = counted_read  # type: ignore[method-assign]
    intake.take_next = counted_take_next  # type: ignore[method-assign]
    intake._start = noted_start  # type: ignore[method-assign]


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("blocker", ["stream", "callback port"])
async def test_a_sidecar_that_cannot_start_writes_its_card_down(
    conn: Connection, blocker: str
) -> None:
    """Its card was written UP, then the start failed (its stream's group refused, its
    callback port taken): the card stayed UP for down_after_s with no one serving it, and
    dispatchers routed work there. The card is DOWN before the error comes out."""
    async with AsyncExitStack() as stack:
        port = 0
        if blocker == "stream":
            await conn.call("SET", conn.keys.queue("w-1"), "not a stream")
        else:
            taken = await stack.enter_async_context(
                await anyio.create_tcp_listener(local_host="127.0.0.1")
            )
            port = taken.extra(anyio.abc.SocketAttribute.local_port)
        transport = HttpAsyncTransport("http://127.0.0.1:9/", timeout_s=1.0, max_connections=1)
        with pytest.raises(BaseException) as raised:
            async with running_sidecar(
                conn, "w-1", ("text.echo",), transport=transport, callback_port=port
            ):
                pass
    said = repr(raised.value)
    assert ("WRONGTYPE" in said) if blocker == "stream" else ("address" in said.lower()), said
    assert await conn.call("HGET", conn.keys.card("w-1"), "state") == b"DOWN"
