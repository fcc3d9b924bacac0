"""``Client.request`` and ``SyncClient``: real redis-server, real HTTP agents on loopback."""

from __future__ import annotations

import logging
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from anyio.from_thread import start_blocking_portal
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker import (
    Client,
    ClientNotOpen,
    InvalidEnvelope,
    RequestTimeout,
    Result,
    SyncClient,
    UnknownMessage,
)
from broker.client import reply_stream_owner
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer, free_port, server_info
from broker.envelope import Envelope
from broker.errors import RedisReplyError, RedisUnavailable
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import Gate, http_agent
from tests.support.harness import eventually, running_dispatcher, running_sidecar


@asynccontextmanager
async def echo_broker(conn: Connection, *, max_inflight: int = 16) -> AsyncIterator[None]:
    """A dispatcher (with its reaper) and one echo agent behind a sidecar."""
    async with (
        http_agent("a") as agent,
        # static credits: these tests are about the client, not the credit limit
        running_sidecar(
            conn,
            "a-1",
            ("text.echo",),
            url=agent.url,
            max_inflight=max_inflight,
            adaptive_credits=False,
        ),
        running_dispatcher(conn),
    ):
        yield


async def stream_length(conn: Connection, stream: str) -> int:
    return int(await conn.call("XLEN", stream))


async def test_500_concurrent_requests_on_one_client_each_get_their_own_result(
    conn: Connection,
) -> None:
    payloads = [{"n": n, "nonce": secrets.token_hex(8)} for n in range(500)]
    results: dict[int, Result] = {}

    async def ask(client: Client, n: int) -> None:
        results[n] = await client.request("text.echo", payloads[n], timeout=120)

    async with echo_broker(conn, max_inflight=100), Client(conn) as client:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for n in range(500):
                    tg.start_soon(ask, client, n)
        stream = client.reply_stream
        assert stream is not None

        async def trimmed() -> bool:  # consumed entries are deleted as the reader goes
            return await stream_length(conn, stream) == 0

        await eventually(trimmed)
        assert int(await conn.call("EXISTS", stream)) == 1

    assert sorted(results) == list(range(500))
    for n, result in results.items():
        assert result.stage is Stage.SUCCEEDED, result
        assert result.result["echo"] == payloads[n]  # its own payload, not a neighbour's
    assert len({r.id for r in results.values()}) == 500
    # every request waited on the client's one reply stream, and closing deleted it
    records = await MessageStore(conn).get_records([r.id for r in results.values()])
    assert {r.reply_to for r in records if r is not None} == {stream}
    assert int(await conn.call("EXISTS", stream)) == 0


async def test_notices_and_other_ids_on_the_reply_stream_do_not_resolve_a_request(
    conn: Connection,
) -> None:
    gate = Gate()
    outcome: dict[str, Result] = {}
    async with (
        http_agent("a", behaviour=gate) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
        Client(conn) as client,
        anyio.create_task_group() as tg,
    ):

        async def ask() -> None:
            outcome["held"] = await client.request("text.echo", {"x": 1}, id="held-1")

        tg.start_soon(ask)
        try:

            async def at_the_agent() -> bool:
                return agent.log.calls["held-1"] == 1

            await eventually(at_the_agent)
            stream = client.reply_stream
            assert stream is not None
            for entry in (
                {"id": "held-1", "stage": "PROCESSING", "notice": "deadline_passed"},
                {"id": "someone-else", "stage": "SUCCEEDED", "result": '{"x": 0}'},
                {"id": "held-1", "stage": "NO-SUCH-STAGE"},  # unreadable: skipped
                # well-formed JSON that no reader builds (5,000 digits): skipped too, where
                # it took the reader, and every request on the client, down
                {"id": "held-1", "stage": "SUCCEEDED", "result": "1" * 5000},
            ):
                await conn.call("XADD", stream, "*", *[x for kv in entry.items() for x in kv])

            async def read_and_deleted() -> bool:
                return await stream_length(conn, stream) == 0

            await eventually(read_and_deleted)
            assert outcome == {}  # the reader saw all four and still waits for the outcome
        finally:
            gate.open()

    held = outcome["held"]
    assert held.id == "held-1" and held.stage is Stage.SUCCEEDED
    assert held.result["echo"] == {"x": 1}


async def test_a_timeout_names_the_message_and_its_result_can_be_read_later(
    conn: Connection,
) -> None:
    async with running_dispatcher(conn), Client(conn) as client:
        with pytest.raises(RequestTimeout) as caught:  # no agent serves text.nobody
            await client.request("text.nobody", {"x": 1}, timeout=0.5, wait_s=0.5)
        message_id = caught.value.message_id
        assert message_id in str(caught.value)
        store = MessageStore(conn)

        async def finished() -> bool:
            record = await store.get_record(message_id)  # None until the dispatcher accepts it
            return record is not None and await client.result(message_id) is not None

        await eventually(finished)
        late = await client.result(message_id)
    assert late is not None and late.id == message_id
    assert late.stage is Stage.EXPIRED  # the request's timeout was also its deadline
    assert (await client.trace(message_id)).record.capability == "text.nobody"


async def test_a_failed_message_is_a_result_that_is_not_ok(conn: Connection) -> None:
    async def refuse(envelope: dict[str, Any], request: Request) -> Response | None:
        return JSONResponse({"detail": "bad order"}, status_code=400)

    async with (
        http_agent("a", behaviour=refuse) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        result = await client.request("text.echo", {"order": 7}, timeout=30)
    assert not result.ok
    assert result.stage is Stage.FAILED
    assert result.error is not None and "400" in result.error and "bad order" in result.error
    assert agent.log.calls[result.id] == 1


async def test_a_bare_client_submits_and_reads_but_cannot_request(conn: Connection) -> None:
    bare = Client(conn)
    with pytest.raises(ClientNotOpen, match="async with Client"):
        await bare.request("text.echo", {"x": 1})
    async with echo_broker(conn):
        sent = await bare.submit(Envelope(capability="text.echo"))

        async def finished() -> bool:  # (unknown until the dispatcher has accepted it)
            record = await MessageStore(conn).get_record(sent)
            return record is not None and await bare.result(sent) is not None

        await eventually(finished)
    result = await bare.result(sent)
    assert result is not None and result.ok
    assert bare.reply_stream is None  # no reader, no reply stream


async def test_request_refuses_invalid_fields_before_submitting(conn: Connection) -> None:
    async with Client(conn) as client:
        with pytest.raises(InvalidEnvelope, match="priority"):
            await client.request("text.echo", None, priority=12)
        with pytest.raises(InvalidEnvelope, match="capability"):
            await client.request("Not A Capability", None)
        with pytest.raises(InvalidEnvelope, match="timeout_s"):
            await client.request("text.echo", None, timeout=0)
        with pytest.raises(TypeError, match="reply_to"):
            await client.request("text.echo", None, reply_to=conn.keys.reply("mine"))
        stream = client.reply_stream
        assert stream is not None  # made on the first request
    assert client.reply_stream is None
    assert int(await conn.call("XLEN", conn.keys.ingress)) == 0  # nothing was submitted


@pytest.mark.parametrize(
    ("url", "owner"),
    [
        ("redis://alice:pw@127.0.0.1:6379/0", "alice"),
        ("rediss://svc.billing_2:pw@h/0?ssl_cert_reqs=none", "svc.billing_2"),
        ("redis://:pw@127.0.0.1:6379/0", "client"),  # the default user: no name given
        ("redis://127.0.0.1:6379/0", "client"),
        ("redis://a%20b:pw@h/0", "client"),  # not a name a stream key can carry as it is
        ("unix:///run/redis.sock", "client"),
    ],
)
def test_reply_streams_are_named_after_the_redis_user(url: str, owner: str) -> None:
    assert reply_stream_owner(url) == owner


async def test_a_client_on_a_named_user_makes_its_reply_streams_under_that_name(
    settings: Settings,
) -> None:
    assert settings.redis_url is not None
    named = settings.redis_url.replace("redis://", "redis://default:any@")  # nopass accepts any
    async with open_connection(settings, named) as conn, Client(conn) as client:
        with pytest.raises(RequestTimeout):  # no dispatcher: only the stream's name matters
            await client.request("text.echo", None, timeout=0.2, wait_s=0.2)
        stream = client.reply_stream
    assert stream is not None and stream.startswith(f"{settings.prefix}:reply:default-")


async def test_a_timeout_leaves_the_connection_and_the_client_as_it_is_not_in_a_group(
    settings: Settings,
) -> None:
    """The README's shape: the try around the whole block catches RequestTimeout itself."""
    assert settings.redis_url is not None
    with pytest.raises(RequestTimeout) as caught:
        async with open_connection(settings, settings.redis_url) as conn, Client(conn) as client:
            await client.request("text.nobody", None, timeout=0.2, wait_s=0.2)
    assert caught.value.message_id


async def test_a_reply_stream_redis_refuses_to_read_fails_its_requests_not_the_client(
    settings: Settings,
) -> None:
    """Its key overwritten with a string (WRONGTYPE ever after): the waiting request and the
    next one say so; the client and its connection go on and close cleanly."""
    assert settings.redis_url is not None
    refused: list[RedisReplyError] = []
    async with open_connection(settings, settings.redis_url) as conn, Client(conn) as client:

        async def ask() -> None:
            with pytest.raises(RedisReplyError) as caught:  # no dispatcher: it would wait
                await client.request("text.echo", None, timeout=30)
            refused.append(caught.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)

            async def opened() -> bool:
                return client.reply_stream is not None

            await eventually(opened)
            assert client.reply_stream is not None
            await conn.call("SET", client.reply_stream, "no stream")
        with pytest.raises(RedisReplyError, match="WRONGTYPE"):
            await client.request("text.echo", None, timeout=30)
        assert await conn.call("PING") == b"PONG"
    assert [e.code for e in refused] == ["WRONGTYPE"]


T = TypeVar("T")


def poll(check: Callable[[], T | None], *, timeout_s: float = 30.0) -> T:
    """Call ``check`` until it returns a value (not None or False); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"still nothing after {timeout_s}s"
        time.sleep(0.02)
    return value


def accepted(client: SyncClient, message_id: str) -> bool:
    try:
        client.trace(message_id)
    except UnknownMessage:  # the dispatcher has not accepted it yet
        return False
    return True


def test_sync_client_from_plain_code(settings: Settings) -> None:
    assert settings.redis_url is not None

    @asynccontextmanager
    async def broker() -> AsyncIterator[None]:
        assert settings.redis_url is not None
        async with open_connection(settings, settings.redis_url) as conn, echo_broker(conn):
            yield

    # the broker on a loop thread of its own; the SyncClient on another, driven from here
    with (
        start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(broker()),
        SyncClient(settings=settings) as client,
    ):
        answered = client.request("text.echo", {"x": 1}, timeout=30)
        assert answered.ok and answered.result["echo"] == {"x": 1}
        timeline = client.trace(answered.id).timeline
        assert timeline[0].stage is Stage.ACCEPTED and timeline[-1].stage is Stage.SUCCEEDED

        payload = msgspec.Raw(msgspec.json.encode({"y": 2}))
        sent = client.submit(Envelope(capability="text.echo", payload=payload))
        polled = poll(lambda: client.result(sent) if accepted(client, sent) else None)
        assert polled.ok and polled.result["echo"] == {"y": 2}

        with pytest.raises(RequestTimeout) as caught:  # through the portal, not wrapped
            client.request("text.nobody", None, timeout=0.3, wait_s=0.3)
        late = caught.value.message_id
        assert poll(lambda: accepted(client, late))
        assert client.trace(late).record.capability == "text.nobody"
    with pytest.raises(ClientNotOpen):
        client.result(sent)


# -- a client started while Redis loads its data ------------------------------------------

LOADED_KEYS = 200_000


def write_aof(path: Path, keys: int) -> None:
    """An append-only file of ``keys`` SETs: what Redis replays at start-up."""
    with path.open("wb") as aof:
        aof.write(b"*2\r\n$6\r\nSELECT\r\n$1\r\n0\r\n")
        for n in range(keys):
            key = b"k%d" % n
            aof.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nv\r\n" % (len(key), key))


@contextmanager
def loading_redis(binary: Path, directory: Path, *, delay: int) -> Iterator[RedisServer]:
    """A redis-server replaying a large AOF, yielded as soon as it answers: while it loads,
    every command gets ``LOADING``. ``--key-load-delay`` (Redis' own test knob; negative:
    pause once in -N keys) stretches the load to seconds whatever the machine."""
    write_aof(directory / "appendonly.aof", LOADED_KEYS)
    port = free_port()
    args = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    args += ["--appendonly", "yes", "--save", "", "--key-load-delay", str(delay)]
    args += ["--logfile", str(directory / "redis.log"), "--daemonize", "no"]
    server = RedisServer(
        subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL),
        port,
        directory,
    )
    try:
        info = poll(lambda: server_info(port, "persistence"), timeout_s=10)
        assert info["loading"] == "1", info  # the premise: it has not loaded yet
        yield server
    finally:
        server.stop()


async def test_a_client_opened_while_redis_loads_its_data_waits_then_works(
    settings: Settings, redis7_binary: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        loading_redis(redis7_binary, tmp_path, delay=-5) as server,
        caplog.at_level(logging.WARNING, logger="agent_reach.connection"),
    ):
        loading = msgspec.structs.replace(settings, redis_url=server.url)
        async with open_connection(loading, server.url) as conn:
            assert int(await conn.call("DBSIZE")) == LOADED_KEYS  # all of it, not a part
            sent = await Client(conn).submit(Envelope(capability="text.echo"))
            assert int(await conn.call("XLEN", conn.keys.ingress)) == 1
    assert sent
    waits = [r.getMessage() for r in caplog.records if "loading its data" in r.getMessage()]
    assert waits == [f"redis at {server.url} is loading its data; waiting up to 120 s"]


async def test_a_redis_that_loads_for_too_long_is_unavailable_with_the_reason(
    settings: Settings, redis7_binary: Path, tmp_path: Path
) -> None:
    with loading_redis(redis7_binary, tmp_path, delay=-2) as server:
        loading = msgspec.structs.replace(settings, redis_url=server.url)
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match=r"still loading its data after 0\.3 s"):
            async with open_connection(loading, server.url, loading_wait_s=0.3):
                pass
        assert time.monotonic() - started < 5  # bounded by the wait, not by the load
