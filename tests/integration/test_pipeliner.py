"""The coalescing pipeliner on a real server: commands issued while a pipeline is on its way
leave on another lane instead of waiting for its answer."""

from __future__ import annotations

import anyio

from broker.embedded import RedisServer
from broker.pipeliner import LANES, Pipeliner
from broker.resp import RespConnection
from tests.support.harness import eventually


async def test_a_command_does_not_wait_for_a_pipeline_already_on_its_way(
    redis_server: RedisServer,
) -> None:
    """One lane is held by a blocking pop; a PING and the push that ends the pop go on the
    other (with one lane both would wait behind the pop, for ever)."""
    assert LANES >= 2
    pipeliner = Pipeliner(redis_server.url, [])
    watcher = await RespConnection.open(redis_server.url)
    popped: list[object] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)

            async def pop() -> None:
                popped.append(await pipeliner.call("BLPOP", "lanes:test", 0))

            tg.start_soon(pop)

            async def pop_is_waiting() -> bool:
                (clients,) = await watcher.execute([("CLIENT", "LIST")])
                return b"cmd=blpop" in clients

            await eventually(pop_is_waiting)
            with anyio.fail_after(5):  # one lane: the PING would wait for the pop, for ever
                assert await pipeliner.call("PING") in (b"PONG", "PONG")
                assert popped == []  # the pop is still on its way
                await pipeliner.call("LPUSH", "lanes:test", "x")

                async def pop_answered() -> bool:
                    return bool(popped)

                await eventually(pop_answered)
            tg.cancel_scope.cancel()
    finally:
        await watcher.close()
    assert popped == [[b"lanes:test", b"x"]]


async def test_an_idle_process_keeps_one_connection(redis_server: RedisServer) -> None:
    """One call after another, none overlapping: the first lane carries them all (the second
    takes work only while the first is busy)."""
    pipeliner = Pipeliner(redis_server.url, [])
    async with anyio.create_task_group() as tg:
        await tg.start(pipeliner.run)
        ids = {await pipeliner.call("CLIENT", "ID") for _ in range(20)}
        tg.cancel_scope.cancel()
    assert len(ids) == 1
