"""The coalescing pipeliner on a real server: commands issued while a pipeline is on its way
leave on another lane instead of waiting for its answer."""

from __future__ import annotations

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from broker.embedded import RedisServer
from broker.errors import RedisUnavailable
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


async def test_a_pipeliner_run_again_after_it_stopped_opens_new_connections(
    redis_server: RedisServer,
) -> None:
    """The connections a stopped run closed are not used again: a pipeliner run a second
    time answers its first call on a connection of its own."""
    pipeliner = Pipeliner(redis_server.url, [])
    ids = []
    for _ in range(2):
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)
            ids.append(await pipeliner.call("CLIENT", "ID"))
            tg.cancel_scope.cancel()
    assert ids[0] != ids[1]


def test_a_pipeliner_run_again_in_another_event_loop_serves_calls(
    redis_server: RedisServer,
) -> None:
    """Nothing of a stopped run's event loop is kept: run again under a new loop, the
    pipeliner answers."""
    pipeliner = Pipeliner(redis_server.url, [])

    async def one_run() -> object:
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)
            answer = await pipeliner.call("PING")
            tg.cancel_scope.cancel()
        return answer

    assert [anyio.run(one_run) for _ in range(2)] == [b"PONG", b"PONG"]


async def test_work_queued_behind_both_lanes_leaves_when_the_first_frees(
    redis_server: RedisServer,
) -> None:
    """A call issued on an idle pipeliner takes its round trip in its own task, on the first
    lane; calls issued meanwhile queue for the lanes' tasks. With the second lane held too,
    a queued PING leaves as soon as the first lane's caller has its answer."""
    pipeliner = Pipeliner(redis_server.url, [])
    watcher = await RespConnection.open(redis_server.url)
    answers: list[tuple[str, object]] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)

            async def call(name: str, *command: object) -> None:
                answers.append((name, await pipeliner.call(*command)))

            async def pops_waiting(count: int) -> bool:
                (clients,) = await watcher.execute([("CLIENT", "LIST")])
                return bytes(clients).count(b"cmd=blpop") == count

            tg.start_soon(call, "first", "BLPOP", "lanes:first", 0)
            await eventually(lambda: pops_waiting(1))
            tg.start_soon(call, "second", "BLPOP", "lanes:second", 0)
            await eventually(lambda: pops_waiting(2))
            tg.start_soon(call, "ping", "PING")
            await watcher.execute([("LPUSH", "lanes:first", "x")])

            async def pinged() -> bool:
                return [name for name, _ in answers] == ["first", "ping"]

            with anyio.fail_after(5):
                await eventually(pinged)
            await watcher.execute([("LPUSH", "lanes:second", "y")])

            async def all_answered() -> bool:
                return len(answers) == 3

            await eventually(all_answered)
            tg.cancel_scope.cancel()
    finally:
        await watcher.close()
    assert answers[-1] == ("second", [b"lanes:second", b"y"])


async def test_a_caller_cancelled_on_the_way_drops_its_connection(
    redis_server: RedisServer,
) -> None:
    """A caller that takes its own round trip and is cancelled before the answer leaves the
    connection out of step: it is closed (the server forgets the blocked pop, which takes
    nothing pushed later) and the next call opens another."""
    pipeliner = Pipeliner(redis_server.url, [])
    watcher = await RespConnection.open(redis_server.url)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)
            with anyio.move_on_after(0.3) as waited:
                await pipeliner.call("BLPOP", "lanes:cancelled", 0)
            assert waited.cancelled_caught

            async def pop_gone() -> bool:
                (clients,) = await watcher.execute([("CLIENT", "LIST")])
                return b"cmd=blpop" not in clients

            await eventually(pop_gone, timeout_s=5)  # not the 30 s a read may take
            await pipeliner.call("LPUSH", "lanes:cancelled", "x")
            assert await pipeliner.call("LLEN", "lanes:cancelled") == 1
            tg.cancel_scope.cancel()
    finally:
        await watcher.close()


async def test_calls_in_a_cancelled_scope_are_sent_on_the_kept_connection(
    redis_server: RedisServer,
) -> None:
    """Clean-up that a cancelled task runs unshielded, once the cancellation has reached it:
    each call is queued for a lane, which sends it, and the caller is cancelled at its wait.
    Taking the round trip itself would drop the connection at the first call and leave the
    next ones unsent."""
    pipeliner = Pipeliner(redis_server.url, [])
    async with anyio.create_task_group() as tg:
        await tg.start(pipeliner.run)
        before = await pipeliner.call("CLIENT", "ID")
        cancelled = 0
        with anyio.CancelScope() as scope:
            try:
                scope.cancel()
                await anyio.sleep(5)  # the work, cancelled
            finally:
                for i in range(3):
                    try:
                        await pipeliner.call("RPUSH", "lanes:clean-up", i)
                    except anyio.get_cancelled_exc_class():
                        cancelled += 1

        async def all_sent() -> bool:
            return await pipeliner.call("LLEN", "lanes:clean-up") == 3

        await eventually(all_sent, timeout_s=5)
        after = await pipeliner.call("CLIENT", "ID")
        tg.cancel_scope.cancel()
    assert cancelled == 3
    assert after == before


class HeldDoor:
    """A loopback TCP door to the real server that holds every connection's first bytes
    until :attr:`opened` is set; :attr:`connections` counts those still open."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.opened = anyio.Event()
        self.connections = 0
        self.port = 0

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.port = listener.extra(SocketAttribute.local_port)
        async with listener:
            task_status.started()
            await listener.serve(self._handle)

    async def _handle(self, client: SocketStream) -> None:
        self.connections += 1
        try:
            async with client, await anyio.connect_tcp("127.0.0.1", self.redis_port) as server:
                await self.opened.wait()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_pump, client, server, tg.cancel_scope)
                    await _pump(server, client, tg.cancel_scope)
        finally:
            self.connections -= 1


async def _pump(source: SocketStream, sink: SocketStream, scope: anyio.CancelScope) -> None:
    try:
        async for chunk in source:
            await sink.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    scope.cancel()  # one side closed: so does the other


async def test_a_connection_that_opens_after_the_pipeliner_stopped_is_closed(
    redis_server: RedisServer,
) -> None:
    """A caller is inside its first connection's set-up (a ``SELECT``, held at the door) when
    the pipeliner stops: when the set-up ends, the connection is closed and the caller told,
    instead of a connection nobody will close carrying its command."""
    door = HeldDoor(redis_server.port)
    told: list[BaseException] = []
    async with anyio.create_task_group() as outer:
        await outer.start(door.serve)
        pipeliner = Pipeliner(f"redis://127.0.0.1:{door.port}/1", [])

        async def caller() -> None:
            try:
                told.append(RuntimeError(f"answered {await pipeliner.call('PING')!r}"))
            except RedisUnavailable as exc:
                told.append(exc)

        async with anyio.create_task_group() as tg:
            await tg.start(pipeliner.run)
            outer.start_soon(caller)

            async def held() -> bool:
                return door.connections == 1

            await eventually(held, timeout_s=5)
            tg.cancel_scope.cancel()
        door.opened.set()

        async def closed() -> bool:
            return bool(told) and door.connections == 0

        await eventually(closed, timeout_s=5)
        outer.cancel_scope.cancel()
    assert isinstance(told[0], RedisUnavailable), told
