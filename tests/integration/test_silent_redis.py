"""A Redis that stops answering (SIGSTOPped: the connection stays up, nothing comes back, as
in a partition) fails a call after that call's own timeout, on a bare connection, whatever
calls came before it on that connection; a connection whose calls are answered is never
closed by the watch on their deadlines, however long it then sits idle."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio import wait_all_tasks_blocked

from broker.embedded import RedisServer
from broker.errors import RedisUnavailable
from broker.resp import RespConnection, describe
from tests.conftest import suite_redis_binary

BOUND_S = 10  # far past every timeout here: a call that hangs fails the test instead


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path / "silent", binary=suite_redis_binary())
    try:
        yield server
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.kill()


async def test_a_silent_redis_fails_a_call_after_its_timeout(server: RedisServer) -> None:
    conn = await RespConnection.open(server.url)
    try:
        assert await conn.execute([("PING",)]) == [b"PONG"]
        server.process.send_signal(signal.SIGSTOP)
        with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable) as silent:
            await conn.execute([("PING",)], timeout_s=0.3)
        # the connection is closed under the call: the next one fails at once, as unavailable
        with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable) as after:
            await conn.execute([("PING",)], timeout_s=30)
    finally:
        await conn.close()
    for failed in (silent.value, after.value):
        assert str(failed) == "redis did not answer within 0.3 s"
        # a timeout, not the close that ended the read: a caller's words for it depend on it
        assert isinstance(failed.__cause__, TimeoutError)
        assert describe(failed.__cause__) == "no answer in time"


async def test_a_redis_that_takes_the_connection_and_never_answers_fails_the_open(
    server: RedisServer,
) -> None:
    """The kernel takes a connection for a stopped (hung) server: the open succeeded and
    only the first call failed, 30 s later. The open asks for an answer within its own
    timeout."""
    server.process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable) as failed:
        await RespConnection.open(server.url, timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert str(failed.value) == f"redis at 127.0.0.1:{server.port} did not answer within 0.3 s"


async def test_a_call_out_when_its_connection_is_closed_ends_there(server: RedisServer) -> None:
    """Closed while a call's write waits for a peer that stopped reading: the call ends at
    once, unavailable, rather than wait for a write that never goes (or its timeout)."""
    conn = await RespConnection.open(server.url)
    outcome: list[BaseException] = []

    async def write_too_much() -> None:
        try:  # more than the sockets between us hold, so the write waits for the peer
            await conn.execute([("SET", "big", b"x" * (48 << 20))], timeout_s=600)
        except RedisUnavailable as exc:
            outcome.append(exc)

    try:
        server.process.send_signal(signal.SIGSTOP)
        with anyio.fail_after(BOUND_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(write_too_much)
                await wait_all_tasks_blocked()
                await conn.close()
    finally:
        await conn.close()
    assert len(outcome) == 1 and isinstance(outcome[0], RedisUnavailable)


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("answered", "timeout_s"),
    [
        # the watch set for the long timeouts before: the short one comes first all the same
        ((60.0, 60.0, 60.0), 0.2),
        # the watch comes due at the deadline of the call answered before, while the call out
        # has a later one: it is not failed before it
        ((0.2,), 1.0),
    ],
)
async def test_a_call_fails_at_its_own_deadline_whatever_came_before(
    server: RedisServer, answered: tuple[float, ...], timeout_s: float
) -> None:
    conn = await RespConnection.open(server.url)
    try:
        for before in answered:
            assert await conn.execute([("PING",)], timeout_s=before) == [b"PONG"]
        server.process.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable) as failed:
            await conn.execute([("PING",)], timeout_s=timeout_s)
        assert time.monotonic() - started >= timeout_s - 0.01  # a timer may fire 1 ms early
        assert str(failed.value) == f"redis did not answer within {timeout_s:g} s"
    finally:
        await conn.close()


async def test_an_answered_connection_outlives_its_deadlines(server: RedisServer) -> None:
    """Idle past the timeouts of its calls (the watch comes due with nothing out), the
    connection still serves, and then still fails a silence."""
    conn = await RespConnection.open(server.url)
    try:
        for _ in range(3):
            assert await conn.execute([("PING",)], timeout_s=0.2) == [b"PONG"]
            await anyio.sleep(0.3)  # what is tested: time passing with nothing out
        assert await conn.execute([("ECHO", "still")], timeout_s=0.2) == [b"still"]
        server.process.send_signal(signal.SIGSTOP)
        with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable, match=r"within 0\.25 s"):
            await conn.execute([("PING",)], timeout_s=0.25)
    finally:
        await conn.close()


async def test_a_connection_given_up_on_is_reset_not_closed_in_order() -> None:
    """The watchdog resets the connection under a call it gave up on (``SO_LINGER`` 0): the
    peer sees a reset, not an orderly end — so what the call wrote and the peer's host had
    not acknowledged (a partition) is dropped rather than sent on for minutes after the
    caller decided. A loopback peer that takes the connection, answers the open's PING and
    then nothing."""
    accepted: list[anyio.abc.SocketStream] = []
    arrived = anyio.Event()

    async def hold(stream: anyio.abc.SocketStream) -> None:
        assert await stream.receive() == b"*1\r\n$4\r\nPING\r\n"  # the open's
        await stream.send(b"+PONG\r\n")
        accepted.append(stream)
        arrived.set()
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        conn = await RespConnection.open(f"redis://127.0.0.1:{port}")
        try:
            with anyio.fail_after(BOUND_S), pytest.raises(RedisUnavailable):
                await conn.execute([("PING",)], timeout_s=0.3)
        finally:
            await conn.close()
        with anyio.fail_after(BOUND_S):
            await arrived.wait()
            (peer,) = accepted
            with pytest.raises(anyio.BrokenResourceError):  # an orderly end: EndOfStream
                while True:
                    await peer.receive()  # the PING, then the reset
        tg.cancel_scope.cancel()


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("answer", "opens"),
    [
        (b"-DENIED Redis is running in protected mode\r\n", False),
        (b"-ERR max number of clients reached\r\n", False),
        (b"-NOAUTH Authentication required.\r\n", True),  # the first call says so
        (b"-LOADING Redis is loading the dataset in memory\r\n", True),  # waited for after
        (b"-BUSY Redis is busy running a script.\r\n", True),  # for a while, as LOADING
    ],
)
async def test_the_open_s_ping_refused_says_why_or_lets_the_first_call_say(
    answer: bytes, opens: bool
) -> None:
    """A server that refuses a client and closes (protected mode, too many clients) sends
    why first: the open says it, where it said only that the connection was lost. A PING
    refused for want of a password, or while loading, leaves that to the first call."""

    async def answer_once(stream: anyio.abc.SocketStream) -> None:
        async with stream:  # closed however this ends (cancelled, for the servers that stay)
            await stream.receive()
            await stream.send(answer)
            if opens:
                await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, answer_once)
        with anyio.fail_after(BOUND_S):
            if opens:
                conn = await RespConnection.open(f"redis://127.0.0.1:{port}", timeout_s=2)
                await conn.close()
            else:
                with pytest.raises(RedisUnavailable) as refused:
                    await RespConnection.open(f"redis://127.0.0.1:{port}", timeout_s=2)
                said = answer[1:].decode().strip()
                assert str(refused.value) == f"redis refused the connection set-up: {said}"
        tg.cancel_scope.cancel()


async def test_a_redis_busy_with_a_script_opens_and_the_call_is_refused_for_a_while(
    server: RedisServer,
) -> None:
    """A real server running a long script answers every new client ``BUSY``: the open's
    PING is answered all the same (the server is there), and a call is refused as
    unavailable for now, not as a broken set-up."""
    busy = await RespConnection.open(server.url)
    watcher = await RespConnection.open(server.url)
    (said,) = await busy.execute([("CONFIG", "SET", "lua-time-limit", "50")])
    assert said == b"OK"
    ended: list[object] = []

    async def run_for_ever() -> None:
        ended.extend(await busy.execute([("EVAL", "while true do end", "0")], timeout_s=BOUND_S))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_for_ever)
            with anyio.fail_after(BOUND_S):
                while True:  # until the script has run past the limit: BUSY from then on
                    (reply,) = await watcher.execute([("PING",)])
                    if reply != b"PONG":
                        break
                assert isinstance(reply, RedisUnavailable) and reply.code == "BUSY"
                conn = await RespConnection.open(server.url, timeout_s=BOUND_S)
                try:
                    (refused,) = await conn.execute([("PING",)])
                    assert isinstance(refused, RedisUnavailable) and refused.code == "BUSY"
                finally:
                    await conn.close()
                (killed,) = await watcher.execute([("SCRIPT", "KILL")])
                assert killed == b"OK"
    finally:
        await watcher.close()
        await busy.close()
    assert len(ended) == 1 and isinstance(ended[0], Exception)
