"""``Client.request`` and ``SyncClient``: real redis-server, real HTTP agents on loopback."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
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
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
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
            ):
                await conn.call("XADD", stream, "*", *[x for kv in entry.items() for x in kv])

            async def read_and_deleted() -> bool:
                return await stream_length(conn, stream) == 0

            await eventually(read_and_deleted)
            assert outcome == {}  # the reader saw all three and still waits for the outcome
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

        async def finished() -> bool:
            return await bare.result(sent) is not None

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
