"""The A2A front door (workers/a2a_gateway.py) driven by the official ``a2a-sdk`` client, with
a real dispatcher, sidecars and HTTP agents behind it on real Redis."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.client import Client as A2AClient
from a2a.helpers import get_data_parts, new_data_part
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from tests.support.agents import Gate, http_agent
from tests.support.harness import (
    connected,
    eventually,
    running_dispatcher,
    running_notifier,
    running_sidecar,
)
from tests.support.webhooks import SECRET, Receiver, serving, signature_ok
from workers.a2a_gateway import gateway_endpoint

API_KEY = "k" * 24


def user_message(capability: str, data: dict[str, Any]) -> Message:
    message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[new_data_part(data)])
    message.metadata.update({"capability": capability})
    return message


@asynccontextmanager
async def front_door(
    conn: Connection, gate: Gate
) -> AsyncIterator[tuple[AgentCard, httpx.AsyncClient]]:
    """Two capabilities behind the gateway: text.echo (quick), text.held (one credit, its
    agent holding every call until ``gate`` opens)."""
    async with (
        http_agent("echo") as quick,
        http_agent("held", behaviour=gate) as held,
        running_sidecar(conn, "echo-1", ("text.echo",), url=quick.url),
        running_sidecar(conn, "held-1", ("text.held",), url=held.url, max_inflight=1),
        running_dispatcher(conn),
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url,
        httpx.AsyncClient(headers={"X-API-Key": API_KEY}, timeout=30) as http,
    ):
        card = await A2ACardResolver(http, url).get_agent_card()
        yield card, http


def sdk_client(card: AgentCard, http: httpx.AsyncClient, *, streaming: bool) -> A2AClient:
    return ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)


async def completed(client: A2AClient, task_id: str) -> Task:
    """``GetTask`` until the task is COMPLETED (polled, with a deadline)."""
    with anyio.fail_after(20):
        while True:
            task = await client.get_task(GetTaskRequest(id=task_id))
            if task.status.state == TaskState.TASK_STATE_COMPLETED:
                return task
            await anyio.sleep(0.05)


async def only_task(client: A2AClient, request: SendMessageRequest) -> Task:
    tasks = [event.task async for event in client.send_message(request) if event.HasField("task")]
    assert len(tasks) == 1
    return tasks[0]


async def test_the_card_lists_capabilities_and_a_blocking_send_returns_the_result(
    conn: Connection,
) -> None:
    gate = Gate()
    async with front_door(conn, gate) as (card, http):
        client = sdk_client(card, http, streaming=False)
        task = await only_task(
            client, SendMessageRequest(message=user_message("text.echo", {"n": 1}))
        )
        gate.open()

    assert {s.id for s in card.skills} >= {"text.echo", "text.held"}
    assert card.security_schemes["apiKey"].api_key_security_scheme.name == "X-API-Key"
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    (artifact,) = task.artifacts
    assert get_data_parts(list(artifact.parts)) == [{"agent": "echo", "echo": {"n": 1.0}}]


async def test_a_non_blocking_send_is_working_then_completed_by_get_task(conn: Connection) -> None:
    gate = Gate()
    async with front_door(conn, gate) as (card, http):
        client = sdk_client(card, http, streaming=False)
        configuration = SendMessageConfiguration(return_immediately=True)
        request = SendMessageRequest(
            message=user_message("text.echo", {"n": 2}), configuration=configuration
        )
        task = await only_task(client, request)
        first = task.status.state
        task = await completed(client, task.id)
        gate.open()

    assert first == TaskState.TASK_STATE_WORKING
    assert get_data_parts(list(task.artifacts[0].parts)) == [{"agent": "echo", "echo": {"n": 2.0}}]


async def held_later(client: A2AClient) -> Task:
    """A send to text.held that returns at once: the task, working or queued."""
    later = SendMessageConfiguration(return_immediately=True)
    message = user_message("text.held", {})
    return await only_task(client, SendMessageRequest(message=message, configuration=later))


async def test_cancel_ends_a_queued_message_and_refuses_an_ended_one(conn: Connection) -> None:
    gate = Gate()
    async with front_door(conn, gate) as (card, http):
        client = sdk_client(card, http, streaming=False)
        busy = await held_later(client)
        queued = await held_later(client)
        cancelled = await client.cancel_task(CancelTaskRequest(id=queued.id))
        gate.open()
        await completed(client, busy.id)
        with pytest.raises(Exception, match="cancel") as refused:
            await client.cancel_task(CancelTaskRequest(id=busy.id))

    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
    assert "TaskNotCancelable" in type(refused.value).__name__


async def test_a_streaming_send_streams_stage_changes_to_the_result(conn: Connection) -> None:
    gate = Gate()
    async with front_door(conn, gate) as (card, http):
        client = sdk_client(card, http, streaming=True)
        kinds, states = [], []
        async for event in client.send_message(
            SendMessageRequest(message=user_message("text.echo", {"n": 3}))
        ):
            kind = event.WhichOneof("payload")
            kinds.append(kind)
            if kind == "status_update":
                states.append(event.status_update.status.state)
        gate.open()

    assert kinds[0] == "task" and "artifact_update" in kinds
    assert states[-1] == TaskState.TASK_STATE_COMPLETED
    assert TaskState.TASK_STATE_WORKING in states


async def test_a_message_the_gateway_did_not_submit_is_no_task_of_its(conn: Connection) -> None:
    """A gateway caller holds the gateway's key, not a Redis user: a producer's own message,
    found by its id, is neither read nor cancelled through the gateway."""
    gate = Gate()
    async with front_door(conn, gate) as (card, http):
        client = sdk_client(card, http, streaming=False)
        busy = await held_later(client)
        producers = await Client(conn).submit(Envelope(capability="text.held"))
        with pytest.raises(Exception, match="not found") as unread:
            await client.get_task(GetTaskRequest(id=producers))
        with pytest.raises(Exception, match="not found") as uncancelled:
            await client.cancel_task(CancelTaskRequest(id=producers))
        forged = f"{busy.id[:-1]}{'0' if busy.id[-1] != '0' else '1'}"
        with pytest.raises(Exception, match="not found"):
            await client.get_task(GetTaskRequest(id=forged))
        gate.open()
        own = await completed(client, busy.id)
        stage = await conn.call("HGET", conn.keys.record(producers), "stage")
    assert "TaskNotFound" in type(unread.value).__name__
    assert "TaskNotFound" in type(uncancelled.value).__name__
    assert own.status.state == TaskState.TASK_STATE_COMPLETED
    assert stage != b"CANCELLED"


async def test_a_request_without_the_api_key_is_refused(conn: Connection) -> None:
    async with gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url:
        async with httpx.AsyncClient() as http:
            body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
            refused = await http.post(url, json=body)
            keyed = await http.post(url, json=body, headers={"X-API-Key": API_KEY})
    assert refused.status_code == 401
    assert keyed.json()["error"]["code"] == -32001


async def test_a_push_config_given_with_the_send_becomes_the_signed_webhook(
    settings: Settings,
) -> None:
    hooked = msgspec.structs.replace(
        settings, webhook_secret=SECRET, callback_hosts=["127.0.0.1"], webhook_backoff_ms=50
    )
    receiver = Receiver()
    async with connected(hooked) as conn, serving(receiver) as hook_url:
        gate = Gate()
        gate.open()
        async with front_door(conn, gate) as (card, http), running_notifier(conn):
            push = TaskPushNotificationConfig(url=hook_url, token="client-token")
            client = ClientFactory(
                ClientConfig(streaming=False, httpx_client=http, push_notification_config=push)
            ).create(card)
            task = await only_task(
                client, SendMessageRequest(message=user_message("text.echo", {"n": 9}))
            )

            async def delivered() -> bool:
                return bool(receiver.accepted)

            await eventually(delivered, timeout_s=20)

    (hit,) = receiver.accepted
    body = msgspec.json.decode(hit.body)
    assert body["id"] == task.id and body["stage"] == "SUCCEEDED"
    assert body["result"] == {"agent": "echo", "echo": {"n": 9.0}}
    assert signature_ok(hit)


async def test_without_a_key_only_json_from_no_other_site_to_loopback_is_served(
    conn: Connection,
) -> None:
    """What a web page could send to a keyless gateway on loopback is refused."""
    body = msgspec.json.encode(
        {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    )
    async with gateway_endpoint(conn, "127.0.0.1", 0, None) as url, httpx.AsyncClient() as http:
        form = await http.post(url, content=body, headers={"Content-Type": "text/plain"})
        cross = await http.post(
            url,
            content=body,
            headers={"Content-Type": "application/json", "Origin": "http://evil.example"},
        )
        rebound = await http.post(
            url, content=body, headers={"Content-Type": "application/json", "Host": "evil.example"}
        )
        plain = await http.post(url, content=body, headers={"Content-Type": "application/json"})
        unparsed = await http.post(
            url, content=body, headers={"Content-Type": "application/json", "Host": "[::1"}
        )
    assert [form.status_code, cross.status_code, rebound.status_code] == [403, 403, 403]
    assert unparsed.status_code == 403  # a 500 and a traceback, before
    assert plain.status_code == 200 and plain.json()["error"]["code"] == -32001


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("method", "configuration", "metadata", "says"),
    [
        ("SendMessage", {"returnImmediately": True}, {"capability": "Demo.Echo"}, "lower-case"),
        ("SendMessage", {"returnImmediately": True}, {"capability": "a" * 10_000}, "characters"),
        ("SendStreamingMessage", {}, {"capability": "Demo.Echo"}, "lower-case"),
        (
            "SendMessage",
            {"returnImmediately": True, "taskPushNotificationConfig": {"url": "ftp://x"}},
            {"capability": "text.echo"},
            "must be an http:// or https:// URL",
        ),
        (  # the test's settings allow no callback host
            "SendStreamingMessage",
            {"taskPushNotificationConfig": {"url": "http://127.0.0.1:9/hook"}},
            {"capability": "text.echo"},
            "is not allowed",
        ),
    ],
)
async def test_a_send_the_dispatcher_would_refuse_is_invalid_params_in_every_mode(
    conn: Connection,
    method: str,
    configuration: dict[str, Any],
    metadata: dict[str, Any],
    says: str,
) -> None:
    """Only a blocking send was checked: one that returned at once, or streamed, answered
    WORKING, and the task was then REJECTED with a dead letter."""
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": metadata}, "configuration": configuration}
    body = {"jsonrpc": "2.0", "id": 7, "method": method, "params": params}
    async with gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url, httpx.AsyncClient() as http:
        answer = await http.post(url, json=body, headers={"X-API-Key": API_KEY})
    error = answer.json()["error"]
    assert error["code"] == -32602 and says in error["message"] and len(error["message"]) < 400
    assert await conn.call("XLEN", conn.keys.ingress) == 0  # nothing was sent


async def raw_exchange(url: str, request: bytes, *, wait_s: float) -> tuple[bytes, bool]:
    """Send ``request`` on a fresh connection and read until the server closes it, or
    ``wait_s``: (what came back, whether the server closed the connection)."""
    address = httpx.URL(url)
    assert address.port is not None
    stream = await anyio.connect_tcp(address.host, address.port)
    received, closed = b"", False
    async with stream:
        await stream.send(request)
        with anyio.move_on_after(wait_s):
            try:
                while True:
                    received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                closed = True
    return received, closed


async def test_a_body_that_does_not_come_is_408_and_a_refused_one_closes_at_once(
    conn: Connection,
) -> None:
    """A client that sent its headers and then nothing, or a refused client that trickled
    its body in, held a connection for as long as it liked: 2,000 of them were open after
    150 s, and a gateway out of file descriptors turned everyone away."""
    head = "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "Content-Length: 1000\r\n"
    async with gateway_endpoint(conn, "127.0.0.1", 0, API_KEY, body_timeout_s=0.5) as url:
        slow, slow_closed = await raw_exchange(
            url, f"{head}X-API-Key: {API_KEY}\r\n\r\n".encode(), wait_s=10
        )
        refused, refused_closed = await raw_exchange(url, f"{head}\r\n{{".encode(), wait_s=10)
    assert slow.startswith(b"HTTP/1.1 408") and slow_closed
    assert refused.startswith(b"HTTP/1.1 401") and refused_closed


async def test_streams_past_the_cap_are_refused_until_one_ends(conn: Connection) -> None:
    """Each open stream looks at Redis until its task ends: 300 of them for a capability no
    agent serves took Redis from 20 to 11,700 commands a second, and nothing capped them."""
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": {"capability": "nobody.here"}}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": params}
    keyed = {"X-API-Key": API_KEY}
    async with (
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY, max_streams=1) as url,
        httpx.AsyncClient(timeout=10) as http,
    ):
        async with http.stream("POST", url, json=body, headers=keyed) as first:
            assert first.status_code == 200
            async for line in first.aiter_lines():  # the stream is open: its first event
                if line.startswith("data: "):
                    break
            refused = await http.post(url, json=body, headers=keyed)

        async def taken_again() -> bool:
            async with http.stream("POST", url, json=body, headers=keyed) as again:
                return again.status_code == 200

        await eventually(taken_again)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == -32000


async def test_a_batch_or_a_body_that_is_no_request_object_is_an_invalid_request(
    conn: Connection,
) -> None:
    call = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    no_version = {k: v for k, v in call.items() if k != "jsonrpc"}
    bodies = [
        [call],
        7,
        "GetTask",
        no_version,
        {**call, "jsonrpc": "1.0"},
        {**call, "id": {"a": 1}},
        {**call, "id": True},
        {**call, "method": ["GetTask"]},
    ]
    async with gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url, httpx.AsyncClient() as http:
        answers = [
            await http.post(url, json=body, headers={"X-API-Key": API_KEY}) for body in bodies
        ]
    assert [a.json()["error"]["code"] for a in answers] == [-32600] * len(bodies)
    # the id is echoed where it is one, null where it is not
    assert [a.json()["id"] for a in answers[3:]] == [1, 1, None, None, 1]


async def test_a_notification_is_run_and_never_answered(conn: Connection) -> None:
    """A request without an id is a notification: JSON-RPC 2.0 says the server must not
    reply. It is run (a send is sent, and returns at once even when it asks to block: no
    one waits for its outcome) and the POST gets an empty 204; one the gateway cannot run
    (no such method, bad params) is not answered either."""
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    send = {"message": {**message, "metadata": {"capability": "text.echo"}}}  # blocking
    calls = [
        {"jsonrpc": "2.0", "method": "SendMessage", "params": send},
        {"jsonrpc": "2.0", "method": "GetTask", "params": {"id": "x"}},
        {"jsonrpc": "2.0", "method": "NoSuchMethod"},
        {"jsonrpc": "2.0", "method": "SendMessage", "params": {"message": 7}},
        {"jsonrpc": "2.0", "method": "SendStreamingMessage", "params": send},
    ]
    async with (
        running_dispatcher(conn),
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url,
        httpx.AsyncClient() as http,
    ):
        answers = [
            await http.post(url, json=call, headers={"X-API-Key": API_KEY}) for call in calls
        ]
    assert [(a.status_code, a.content) for a in answers] == [(204, b"")] * len(calls)
    records = await conn.call("KEYS", conn.keys.record("*"))
    assert len(records) == 1  # the send's; the stream was never started


async def test_streams_asked_for_at_once_are_held_to_the_cap(conn: Connection) -> None:
    """The cap was counted once a stream began, after its message was sent: 40 asked for
    at once, against a cap of 2, all got a stream."""
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": {"capability": "nobody.here"}}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": params}
    statuses: list[int] = []
    all_answered = anyio.Event()

    async def ask(http: httpx.AsyncClient, url: str) -> None:
        async with http.stream("POST", url, json=body, headers={"X-API-Key": API_KEY}) as r:
            statuses.append(r.status_code)
            if len(statuses) == 20:
                all_answered.set()
            await all_answered.wait()  # held open until every one has its answer

    async with (
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY, max_streams=2) as url,
        httpx.AsyncClient(timeout=20) as http,
        anyio.create_task_group() as tg,
    ):
        for _ in range(20):
            tg.start_soon(ask, http, url)
    assert sorted(statuses) == [200] * 2 + [503] * 18


async def test_a_body_over_the_limit_is_413_to_a_client_still_sending_it(
    conn: Connection,
) -> None:
    async with gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url, httpx.AsyncClient() as http:
        answer = await http.post(url, content=b"x" * 8_000_000, headers={"X-API-Key": API_KEY})
    assert answer.status_code == 413


async def test_a_blocking_send_stops_waiting_when_its_client_hangs_up(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A blocking send waited up to 300 s for an outcome after its caller had gone: the
    connection's slot was free again, the wait was not, so a client that hung up at once
    could pile up waits without bound. The message itself goes on."""
    caplog.set_level(logging.INFO, logger="agent_reach.a2a_gateway")
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": {"capability": "text.nobody"}}}
    body = {"jsonrpc": "2.0", "id": 9, "method": "SendMessage", "params": params}
    async with (
        running_dispatcher(conn),
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url,
        httpx.AsyncClient() as http,
    ):
        with pytest.raises(httpx.ReadTimeout):  # no one serves text.nobody: it waits
            await http.post(url, json=body, headers={"X-API-Key": API_KEY}, timeout=1.0)

        async def gave_up() -> bool:
            return "SendMessage 9 no longer answered" in caplog.text

        await eventually(gave_up, timeout_s=10)
    records = await conn.call("KEYS", conn.keys.record("*"))
    assert len(records) == 1  # sent all the same, and left to run


async def test_a_hang_up_after_bytes_sent_ahead_is_noticed_too(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes sent while the request is answered (a pipelined request, or junk) made the
    server stop reading the socket until its answer was out, and with it the hang-up: the
    blocking send waited on, its connection's slot held, for 300 s."""
    caplog.set_level(logging.INFO, logger="agent_reach.a2a_gateway")
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": {"capability": "text.nobody"}}}
    body = msgspec.json.encode(
        {"jsonrpc": "2.0", "id": 9, "method": "SendMessage", "params": params}
    )
    async with (
        running_dispatcher(conn),
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY) as url,
    ):
        address = httpx.URL(url)
        assert address.port is not None
        head = (
            f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        async with await anyio.connect_tcp(address.host, address.port) as stream:
            await stream.send(head.encode() + body)

            async def sent() -> bool:  # the gateway has the message: its wait has begun
                return len(await conn.call("KEYS", conn.keys.record("*"))) == 1

            await eventually(sent)
            await stream.send(b"GET / HTTP/1.1\r\n")  # ahead of the answer
            await anyio.wait_all_tasks_blocked()

        async def gave_up() -> bool:
            return "SendMessage 9 no longer answered" in caplog.text

        await eventually(gave_up, timeout_s=10)
        # a request sent ahead, however large, is still answered after the one under way
        get = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
        big = msgspec.json.encode({**get, "id": 2, "pad": "x" * 100_000})
        small = msgspec.json.encode(get)
        two = b"".join(
            f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n".encode()
            + b
            for b in (small, big)
        )
        received = b""
        async with await anyio.connect_tcp(address.host, address.port) as stream:
            await stream.send(two)
            with anyio.fail_after(10):
                while received.count(b'"code":-32001') < 2:
                    received += await stream.receive()
        assert received.count(b"HTTP/1.1 200") == 2


async def test_a_stream_whose_task_expires_ends_with_that_state(conn: Connection) -> None:
    """A stream gave up at the task's deadline, just before the reaper wrote EXPIRED: it
    ended with the task still SUBMITTED, and no final state. It waits the reaper's grace
    too, so its last event is the task's end."""
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    params = {"message": {**message, "metadata": {"capability": "nobody.here"}}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": params}
    async with (
        running_dispatcher(conn),
        gateway_endpoint(conn, "127.0.0.1", 0, API_KEY, task_timeout_s=1.0) as url,
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", url, json=body, headers={"X-API-Key": API_KEY}) as stream,
    ):
        lines = [line async for line in stream.aiter_lines()]
    events = [msgspec.json.decode(line[6:])["result"] for line in lines if line[:6] == "data: "]
    last = events[-1]["statusUpdate"]["status"]
    assert last["state"] == "TASK_STATE_FAILED", events
    # EXPIRED, with why nothing served it
    assert "no instance serves 'nobody.here'" in msgspec.json.encode(last).decode(), last
