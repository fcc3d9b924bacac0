"""The one Redis boundary against a real redis-server: every error reply reaches the rest of
the code as a :class:`RedisReplyError` with its code, every lost connection as
:class:`RedisUnavailable` with the failure in ``__cause__`` — through a bare connection, the
pipeliner and a blocking reader alike."""

from __future__ import annotations

import pytest

from broker.cluster_map import ORDER_BARRIER
from broker.connection import Connection, ensure_group
from broker.errors import RedisReplyError, RedisUnavailable
from broker.resp import RespConnection
from broker.scripts import ScriptName
from broker.timeline import note_event


async def client_id(conn: Connection, says: str) -> tuple[str, int]:
    """The server and id of the one client whose ``CLIENT LIST`` line says ``says``."""
    found = []
    for node in conn.nodes:
        lines = (await conn.call_on(node, "CLIENT", "LIST", "TYPE", "normal")).decode()
        found += [(node, line) for line in lines.splitlines() if f" {says} " in f" {line} "]
    ((node, line),) = found
    return node, int(line.split()[0].removeprefix("id="))


async def error_of(conn: Connection, *command: object) -> RedisReplyError:
    with pytest.raises(RedisReplyError) as caught:
        await conn.call(*command)
    return caught.value


async def test_error_replies_carry_their_code(conn: Connection) -> None:
    key = conn.keys.record("boundary")
    await conn.call("SET", key, "a string")

    wrong = await error_of(conn, "LPUSH", key, "x")
    nogroup = await error_of(conn, "XREADGROUP", "GROUP", "g", "c", "STREAMS", key + "s", ">")
    unknown = await error_of(conn, "NO-SUCH-COMMAND")

    assert (wrong.code, nogroup.code, unknown.code) == ("WRONGTYPE", "NOGROUP", "ERR")
    assert str(wrong) == wrong.message and wrong.message.startswith("WRONGTYPE ")


async def test_error_replies_of_a_batch_come_back_in_place(conn: Connection) -> None:
    key = conn.keys.record("batch")
    replies = await conn.call_many([("SET", key, "v"), ("LPUSH", key, "x"), ("GET", key)])

    assert replies[0] == b"OK" and replies[2] == b"v"
    assert isinstance(replies[1], RedisReplyError) and replies[1].code == "WRONGTYPE"


async def test_a_group_that_exists_is_busygroup_handled_by_its_code(conn: Connection) -> None:
    stream = conn.keys.queue("boundary")
    await ensure_group(conn, stream, "g")
    await ensure_group(conn, stream, "g")  # BUSYGROUP: nothing to do

    assert (await conn.call("XINFO", "GROUPS", stream))[0][1] == b"g"
    await conn.call("SET", conn.keys.queue("not-a-stream"), "x")
    with pytest.raises(RedisUnavailable, match="cannot create group g") as caught:
        await ensure_group(conn, conn.keys.queue("not-a-stream"), "g")  # WRONGTYPE
    assert isinstance(caught.value.__cause__, RedisReplyError)
    assert caught.value.__cause__.code == "WRONGTYPE"


async def test_scripts_redis_forgot_are_loaded_again_on_noscript(conn: Connection) -> None:
    sha = conn.scripts[ScriptName.NOTE].sha
    for node in conn.nodes:  # every master of a cluster
        assert await conn.call_on(node, "SCRIPT", "FLUSH") == b"OK"
        assert await conn.call_on(node, "SCRIPT", "EXISTS", sha) == [0]

    # the pipeliner sees NOSCRIPT, loads every script and runs the call again
    assert await note_event(conn, "no-such-message", "EVENT", "why", now_ms=1) is False
    loaded = [await conn.call_on(node, "SCRIPT", "EXISTS", sha) for node in conn.nodes]
    assert [1] in loaded  # where the call ran


async def test_a_connection_redis_drops_is_unavailable_and_the_pipeliner_reconnects(
    conn: Connection,
) -> None:
    own_id = await conn.call("CLIENT", "ID")
    await conn.call("CLIENT", "KILL", "ID", own_id, "SKIPME", "no")  # answered, then closed

    with pytest.raises(RedisUnavailable) as caught:
        await conn.call("PING")
    assert isinstance(caught.value.__cause__, OSError)
    assert await conn.call("PING") == b"PONG"  # a new connection
    assert await conn.call("CLIENT", "ID") != own_id


async def test_a_dropped_connection_fails_execute_and_read_one_alike(conn: Connection) -> None:
    # A read meets the close (end of file). A write after it may instead meet the reset the
    # peer's host answers it with, whichever the kernel reports first: both are a lost
    # connection, and both must say so the same way.
    lost = {
        "execute": r"redis closed the connection|\[Errno \d+\] Connection reset by peer",
        "read_one": "redis closed the connection",
    }
    for read in ("execute", "read_one"):
        bare = await RespConnection.open(conn.url)
        try:
            assert await bare.execute([("QUIT",)]) == [b"OK"]
            with pytest.raises(
                RedisUnavailable, match=f"^redis unavailable: ({lost[read]})"
            ) as caught:
                if read == "execute":
                    await bare.execute([("PING",)])
                else:
                    await bare.read_one()
            assert isinstance(caught.value.__cause__, OSError)
        finally:
            await bare.close()


async def test_a_blocking_reader_raises_error_replies_and_survives_a_lost_connection(
    conn: Connection,
) -> None:
    stream = conn.keys.queue("reader")
    async with conn.reader() as reader:
        await conn.call("SET", conn.keys.queue("not-a-stream"), "x")
        with pytest.raises(RedisReplyError) as caught:
            await reader.read(conn.keys.queue("not-a-stream"), "g", "c", count=1, block_ms=None)
        assert caught.value.code == "WRONGTYPE"

        await ensure_group(conn, stream, "g")
        await conn.call("XADD", stream, "*", "id", "m-1", "attempt", "1")
        assert [f for _, f in await reader.read(stream, "g", "c", count=1, block_ms=None)] == [
            {"id": b"m-1", "attempt": b"1"}
        ]
        node, reader_id = await client_id(conn, "cmd=xreadgroup")
        await conn.call_on(node, "CLIENT", "KILL", "ID", reader_id)
        with pytest.raises(RedisUnavailable):
            await reader.read(stream, "g", "c", count=1, block_ms=None, pending=True)
        pending = await reader.read(stream, "g", "c", count=1, block_ms=None, pending=True)
        assert [f["id"] for _, f in pending] == [b"m-1"]  # reconnected


async def test_a_reader_whose_group_is_lost_creates_it_again_and_reads_from_the_start(
    conn: Connection,
) -> None:
    """A Redis that restarts without its last second of writes (``appendfsync everysec``)
    can come back with a work stream but not its group, or neither: the reader carries on."""
    stream = conn.keys.queue("lost-group")
    async with conn.reader() as reader:
        assert await reader.read(stream, "g", "c", count=1, block_ms=None, pending=True) == []
        await conn.call("XADD", stream, "*", "id", "m-1", "attempt", "1")
        await conn.call("XGROUP", "DESTROY", stream, "g")

        entries = await reader.read(stream, "g", "c", count=10, block_ms=None)

        assert [f["id"] for _, f in entries] == [b"m-1"]  # written before the loss: not skipped
        assert (await conn.call("XINFO", "GROUPS", stream))[0][1] == b"g"


async def test_an_order_barrier_is_answered_none_in_its_place(conn: Connection) -> None:
    key = conn.keys.record("barrier")
    replies = await conn.call_many([("SET", key, "1"), ORDER_BARRIER, ("GET", key)])
    assert replies == [b"OK", None, b"1"]
