"""Async agents (``http-async``): 202 now, the result later on the sidecar's callback endpoint.

A late answer is never thrown away: a callback is taken as long as the message is not
terminal, past the sync call timeout and past the callback timeout alike.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest

from adapters.callbacks import TOKEN_HEADER, CallbackTokens
from adapters.http import HttpAsyncTransport
from adapters.sidecar import Sidecar
from broker.client import Client
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.records import MessageRecord
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.async_agents import (
    AsyncAgent,
    async_agent,
    raw_connection,
    raw_post,
    read_response,
    read_until_closed,
    status_of,
)
from tests.support.harness import collect_replies, eventually, running_dispatcher, running_sidecar
from tests.support.usage_days import usage_lately

INSTANCE = "thinker-1"


@asynccontextmanager
async def clocks(conn: Connection, **changes: float) -> AsyncIterator[Connection]:
    quick = msgspec.structs.replace(conn.settings, **changes)
    assert quick.redis_url is not None
    async with open_connection(quick, quick.redis_url) as changed:
        yield changed


@asynccontextmanager
async def async_sidecar(
    conn: Connection,
    agent: AsyncAgent,
    *,
    status: bool = False,
    idempotent: bool = False,
    callback_port: int = 0,
) -> AsyncIterator[Sidecar]:
    transport = HttpAsyncTransport(
        agent.url, timeout_s=conn.settings.sync_call_timeout_s, max_connections=8
    )
    async with running_sidecar(
        conn,
        INSTANCE,
        ("text.think",),
        transport=transport,
        url=agent.url,
        status_url=agent.status_url if status else "",
        idempotent=idempotent,
        callback_port=callback_port,
    ) as sidecar:
        yield sidecar


def envelope(reply_to: str, payload: object = "hello", **fields: object) -> Envelope:
    raw = msgspec.json.encode(
        {"capability": "text.think", "reply_to": reply_to, "payload": payload, **fields}
    )
    return msgspec.json.decode(raw, type=Envelope)


async def record_of(conn: Connection, message_id: str) -> MessageRecord:
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None
    return record


async def stages_of(conn: Connection, message_id: str) -> list[str]:
    return [str(e.stage) for e in await MessageStore(conn).get_timeline(message_id)]


async def taken_by_agent(agent: AsyncAgent, conn: Connection, message_id: str) -> None:
    """Until the agent has the request and the record says it awaits the callback."""

    async def awaiting() -> bool:
        if message_id not in agent.received:
            return False
        return (await record_of(conn, message_id)).awaiting_callback

    await eventually(awaiting, timeout_s=20)


async def submitted(
    conn: Connection, agent: AsyncAgent | None = None, payload: object = "hello"
) -> tuple[str, str]:
    """A message on its own reply stream: (reply stream, id); with ``agent``, once the agent
    has it and the record says it awaits the callback."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    message_id = await client.submit(envelope(reply_to, payload))
    if agent is not None:
        await taken_by_agent(agent, conn, message_id)
    return reply_to, message_id


async def credits_in_use(conn: Connection) -> int:
    return int(await conn.call("SCARD", conn.keys.inflight(INSTANCE)))


def subsequence(wanted: list[str], stages: list[str]) -> bool:
    rest = iter(stages)
    return all(stage in rest for stage in wanted)


async def test_a_callback_after_the_sync_timeout_is_delivered_not_dropped(
    conn: Connection,
) -> None:
    """The agent calls back after 4 s; the sync call timeout is 3 s."""
    async with (
        clocks(conn, sync_call_timeout_s=3.0, processing_grace_s=0.5) as conn,
        async_agent(call_back_after_s=4.0) as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent, status=True),
    ):
        reply_to, message_id = await submitted(conn, agent, {"question": 42})
        assert await credits_in_use(conn) == 1  # the agent has it: its credit stays taken
        replies = await collect_replies(conn, reply_to, 1, timeout_s=30)

        result = replies[message_id]
        assert result.stage is Stage.SUCCEEDED
        assert result.result == {"echo": {"question": 42}}
        assert [c.status for c in agent.callbacks] == [200]
        stages = await stages_of(conn, message_id)
        assert subsequence(["PROCESSING", "CALLBACK_RECEIVED", "SUCCEEDED"], stages), stages
        assert stages.count("SUCCEEDED") == 1
        record = await record_of(conn, message_id)
        assert record.agent_task == f"task-{message_id}"

        async def credit_returned() -> bool:
            return await credits_in_use(conn) == 0

        await eventually(credit_returned, timeout_s=10)


async def instance_tokens(conn: Connection) -> CallbackTokens:
    """The tokens the sidecar hands out, from the instance key it keeps in Redis."""
    return CallbackTokens(await conn.call("GET", conn.keys.callback_key(INSTANCE)))


async def test_a_bad_token_is_401_whether_or_not_the_id_exists(conn: Connection) -> None:
    """Nothing about an id is revealed to a caller without its token: the same 401 for a
    forged token, an earlier form of forged token, another message's token and none at all,
    on a known id and an unknown one alike; nothing changes."""
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        _, message_id = await submitted(conn, agent)
        before = await record_of(conn, message_id)
        timeline = await stages_of(conn, message_id)
        known = agent.received[message_id].callback_url
        unknown = known.rsplit("/", 1)[0] + "/no-such-id"
        tokens = await instance_tokens(conn)
        other = tokens.token("another-message", 1)

        answers = []
        for url in (known, unknown):
            for token in ("1." + "0" * 64, "0" * 64, other, tokens.token(message_id, 1)[:-1]):
                response = await agent.client.post(
                    url, json={"result": "evil"}, headers={TOKEN_HEADER: token}
                )
                answers.append((response.status_code, response.json()))
            missing = await agent.client.post(url, json={"result": "evil"})
            answers.append((missing.status_code, {}))

        refused = {"error": "callback token does not match"}
        assert answers == [(401, refused)] * 4 + [(401, {})] + [(401, refused)] * 4 + [(401, {})]
        after = await record_of(conn, message_id)
        assert after.stage is Stage.PROCESSING and after.result is None
        assert after.updated_ms == before.updated_ms
        assert await stages_of(conn, message_id) == timeline
        # a good token for an id with no record: only now is "unknown" said
        response = await agent.client.post(
            unknown, json={"result": 1}, headers={TOKEN_HEADER: tokens.token("no-such-id", 1)}
        )
        assert response.status_code == 404


async def test_a_token_of_the_earlier_bare_hex_form_still_settles(conn: Connection) -> None:
    """Callbacks handed out before tokens carried their attempt still land."""
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)
        token = agent.received[message_id].token
        assert token.startswith("1.")

        answer = await agent.call_back(message_id, {"result": "old"}, token=token[2:])
        replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].result == "old"


async def test_a_duplicate_callback_is_recorded_once(conn: Connection) -> None:
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)

        first = await agent.call_back(message_id, {"result": {"n": 1}})
        second = await agent.call_back(message_id, {"result": {"n": 2}})
        replies = await collect_replies(conn, reply_to, 1)

        assert first.status == 200 and "duplicate" not in first.body
        assert second.status == 200 and second.body["duplicate"] is True
        assert replies[message_id].result == {"n": 1}

        async def ended() -> bool:
            return (await record_of(conn, message_id)).stage is Stage.SUCCEEDED

        await eventually(ended)
        stages = await stages_of(conn, message_id)
        assert stages.count("CALLBACK_RECEIVED") == 1 and stages.count("SUCCEEDED") == 1
        assert (await record_of(conn, message_id)).result == b'{"n":1}'
        third = await agent.call_back(message_id, {"error": "too late"})
        assert third.status == 200 and third.body == {
            "id": message_id,
            "stage": "SUCCEEDED",
            "duplicate": True,
        }
        assert int(await conn.call("XLEN", reply_to)) == 1


async def test_unknown_id_is_404_bad_body_400_oversize_413(conn: Connection) -> None:
    async with (
        clocks(conn, max_callback_bytes=1024) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        _, message_id = await submitted(conn, agent)
        taken = agent.received[message_id]
        base = taken.callback_url.rsplit("/", 1)[0]
        headers = {TOKEN_HEADER: taken.token}

        valid_for_unknown = {TOKEN_HEADER: (await instance_tokens(conn)).token("no-such-id", 1)}
        unknown = await agent.client.post(
            f"{base}/no-such-id", json={"result": 1}, headers=valid_for_unknown
        )
        neither = await agent.client.post(taken.callback_url, json={"x": 1}, headers=headers)
        both = await agent.client.post(
            taken.callback_url, json={"result": 1, "error": "e"}, headers=headers
        )
        not_json = await agent.client.post(taken.callback_url, content=b"{", headers=headers)
        huge = await agent.client.post(
            taken.callback_url, json={"result": "x" * 2000}, headers=headers
        )

        assert unknown.status_code == 404
        assert neither.status_code == 400 and "exactly one of" in neither.json()["error"]
        assert both.status_code == 400
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
        assert huge.status_code == 413 and "1024-byte limit" in huge.json()["error"]
        assert (await record_of(conn, message_id)).stage is Stage.PROCESSING


async def test_a_failure_reported_by_callback_ends_failed(conn: Connection) -> None:
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)

        answer = await agent.call_back(message_id, {"error": "could not parse the invoice"})
        replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].stage is Stage.FAILED
        assert replies[message_id].error == "could not parse the invoice"


async def test_a_callback_past_the_callback_timeout_is_still_taken(conn: Connection) -> None:
    """Callback timeout 1 s: the reaper asks the status endpoint ("running"), lets it run on,
    and the callback that comes later is taken."""
    async with (
        clocks(conn, callback_timeout_s=1.0, delivery_timeout_s=1.0, sweep_interval_s=0.1) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent, status=True),
    ):
        reply_to, message_id = await submitted(conn, agent)

        async def asked_twice() -> bool:
            return agent.status_queries.count(message_id) >= 2

        await eventually(asked_twice, timeout_s=20)
        assert (await record_of(conn, message_id)).stage is Stage.PROCESSING
        answer = await agent.call_back(message_id, {"result": "late but fine"})
        replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].result == "late but fine"


async def test_late_callback_status_done_is_recorded_and_the_callback_is_a_duplicate(
    conn: Connection,
) -> None:
    async with (
        clocks(conn, callback_timeout_s=1.0, delivery_timeout_s=1.0, sweep_interval_s=0.1) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent, status=True),
    ):
        agent.status = "done"
        reply_to, message_id = await submitted(conn)
        replies = await collect_replies(conn, reply_to, 1, timeout_s=20)

        assert replies[message_id].result == {"from": "status"}

        async def credit_returned() -> bool:
            return await credits_in_use(conn) == 0

        await eventually(credit_returned, timeout_s=10)  # the sidecar let go of it
        answer = await agent.call_back(message_id, {"result": "after all"})
        assert answer.status == 200 and answer.body["duplicate"] is True
        assert (await record_of(conn, message_id)).result == b'{"from":"status"}'


async def test_a_callback_settles_a_message_parked_for_an_operator(conn: Connection) -> None:
    """No status endpoint, not idempotent: past the callback timeout it is parked as
    NEEDS_CONFIRMATION; the agent's late callback is the confirmation."""
    async with (
        clocks(conn, callback_timeout_s=0.5, delivery_timeout_s=1.0, sweep_interval_s=0.1) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn)

        async def parked() -> bool:  # (no record yet until the dispatcher accepts it)
            record = await MessageStore(conn).get_record(message_id)
            return record is not None and record.stage is Stage.NEEDS_CONFIRMATION

        await eventually(parked, timeout_s=20)

        async def credit_returned() -> bool:
            return await credits_in_use(conn) == 0

        await eventually(credit_returned, timeout_s=10)
        used = {"output_tokens": 5, "cost": 0.25}
        answer = await agent.call_back(message_id, {"result": "done after all", "usage": used})
        replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].result == "done after all"
        stages = await stages_of(conn, message_id)
        assert subsequence(["NEEDS_CONFIRMATION", "CALLBACK_RECEIVED", "SUCCEEDED"], stages)
        # the late callback is charged like any other: its usage, a succeeded request
        stored = await conn.call("HGET", conn.keys.record(message_id), "usage:1")
        assert stored is not None and json.loads(stored) == used
        [row] = await usage_lately(conn, "capability")
        figures = row.as_json()
        assert (figures["succeeded"], figures["cost"]) == (1, 0.25)


@pytest.mark.anyio
async def test_a_restarted_sidecar_still_takes_the_callbacks_it_handed_out(
    conn: Connection,
) -> None:
    """Tokens are derived from a key kept in Redis: the callback of work taken before a
    restart is accepted by the new sidecar process on the same port."""
    async with async_agent() as agent, running_dispatcher(conn):
        async with async_sidecar(conn, agent) as first:
            port = httpx.URL(first.callback_url).port
            assert port is not None
            reply_to, message_id = await submitted(conn, agent)
        async with async_sidecar(conn, agent, callback_port=port) as second:
            assert second.callback_url == first.callback_url
            answer = await agent.call_back(message_id, {"result": "survived"})
            replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].result == "survived"


async def test_a_202_whose_body_is_not_json_is_still_taken(conn: Connection) -> None:
    async with (
        async_agent(plain_202=True) as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)
        assert (await record_of(conn, message_id)).agent_task == ""

        answer = await agent.call_back(message_id, {"result": "fine"})
        replies = await collect_replies(conn, reply_to, 1)

        assert answer.status == 200
        assert replies[message_id].stage is Stage.SUCCEEDED


async def test_a_retry_to_the_same_instance_lets_go_of_the_old_attempt(conn: Connection) -> None:
    """Idempotent, no status endpoint: past the callback timeout the reaper retries, and the
    only instance takes attempt 2. Attempt 1's credit is returned at once, its token no
    longer settles anything, attempt 2 awaits its own callback."""
    async with (
        clocks(conn, callback_timeout_s=1.0, delivery_timeout_s=1.0, sweep_interval_s=0.1) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent, idempotent=True),
    ):
        reply_to, message_id = await submitted(conn, agent)
        first = agent.received[message_id]

        async def second_attempt_awaits() -> bool:
            record = await record_of(conn, message_id)
            return record.attempt == 2 and record.awaiting_callback

        await eventually(second_attempt_awaits, timeout_s=20)

        async def only_the_second_holds_a_credit() -> bool:
            members = await conn.call("SMEMBERS", conn.keys.inflight(INSTANCE))
            return members == [f"{message_id}:2".encode()]

        await eventually(only_the_second_holds_a_credit, timeout_s=5)
        stale = await agent.call_back(message_id, {"result": "old"}, token=first.token)
        assert stale.status == 409 and "no longer current" in stale.body["error"]
        answer = await agent.call_back(message_id, {"result": "new"})
        replies = await collect_replies(conn, reply_to, 1)
        assert answer.status == 200 and replies[message_id].result == "new"

        async def credit_returned() -> bool:
            return await credits_in_use(conn) == 0

        await eventually(credit_returned, timeout_s=10)


async def test_a_chunked_body_past_the_limit_is_413_and_changes_nothing(conn: Connection) -> None:
    """2 MB in chunks, no Content-Length to refuse up front: the endpoint stops at the limit."""
    async with (
        clocks(conn, max_callback_bytes=1024) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        _, message_id = await submitted(conn, agent)
        taken = agent.received[message_id]
        before = await record_of(conn, message_id)

        async def two_megabytes() -> AsyncIterator[bytes]:
            yield b'{"result": "'
            for _ in range(2048):
                yield b"x" * 1024
            yield b'"}'

        response = await agent.client.post(
            taken.callback_url, content=two_megabytes(), headers={TOKEN_HEADER: taken.token}
        )

        assert response.request.headers.get("transfer-encoding") == "chunked"
        assert response.status_code == 413 and "1024-byte limit" in response.json()["error"]
        after = await record_of(conn, message_id)
        assert after.stage is Stage.PROCESSING and after.updated_ms == before.updated_ms
        assert after.result is None


async def test_a_lying_content_length_reads_no_further_than_declared(conn: Connection) -> None:
    """Declared 16 bytes, sent 3000: the first 16 are the body (not JSON: 400); declared
    past the limit, sent little: 413 before reading. The message stays as it was."""
    async with (
        clocks(conn, max_callback_bytes=1024) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        _, message_id = await submitted(conn, agent)
        taken = agent.received[message_id]
        body = b'{"result": "' + b"x" * 3000 + b'"}'

        answers = []
        for declared, sent in ((16, body), (10_000_000, b'{"result": 1}')):
            async with raw_connection(taken.callback_url) as stream:
                await stream.send(
                    raw_post(taken.callback_url, taken.token, sent, content_length=declared)
                )
                answers.append(await read_until_closed(stream, timeout_s=10))

        assert status_of(answers[0]) == 400 and b"not JSON" in answers[0]
        assert status_of(answers[1]) == 413
        assert (await record_of(conn, message_id)).stage is Stage.PROCESSING


async def test_json_nested_too_deep_is_400_and_within_the_limit_is_taken(
    conn: Connection,
) -> None:
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)
        taken = agent.received[message_id]
        headers = {TOKEN_HEADER: taken.token, "Content-Type": "application/json"}

        def nested(depth: int) -> bytes:
            return b'{"result": ' + b"[" * depth + b"1" + b"]" * depth + b"}"

        deep = await agent.client.post(taken.callback_url, content=nested(100), headers=headers)
        assert deep.status_code == 400
        assert "nested 101 levels deep; at most 64" in deep.json()["error"]
        assert (await record_of(conn, message_id)).stage is Stage.PROCESSING

        fine = await agent.client.post(taken.callback_url, content=nested(60), headers=headers)
        replies = await collect_replies(conn, reply_to, 1)

        assert fine.status_code == 200
        result: object = replies[message_id].result
        for _ in range(60):
            assert isinstance(result, list)
            (result,) = result
        assert result == 1


async def test_a_connection_that_never_finishes_its_headers_is_closed(conn: Connection) -> None:
    """Header timeout 1 s: half a request's headers, then silence — the sidecar closes the
    connection, while callbacks on other connections go on; the same for the second request
    on a kept-alive connection (uvicorn's keep-alive timer, 5 s, stops at its first byte)."""
    async with (
        clocks(conn, callback_header_timeout_s=1.0) as conn,
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
    ):
        reply_to, message_id = await submitted(conn, agent)
        taken = agent.received[message_id]
        half = raw_post(taken.callback_url, taken.token, b"", content_length=0).split(b"\r\n")[0]

        async with raw_connection(taken.callback_url) as slow:
            await slow.send(half + b"\r\nHost: 127")
            opened = anyio.current_time()
            answer = await agent.call_back(message_id, {"result": "meanwhile"})
            closed_with = await read_until_closed(slow, timeout_s=10)
            waited = anyio.current_time() - opened

        assert closed_with == b""  # closed, not answered
        assert 0.9 <= waited < 5
        assert answer.status == 200
        assert (await collect_replies(conn, reply_to, 1))[message_id].result == "meanwhile"

        async with raw_connection(taken.callback_url) as kept:
            first = raw_post(taken.callback_url, taken.token, b"{}", content_length=2)
            await kept.send(first.replace(b"Connection: close", b"Connection: keep-alive"))
            assert status_of(await read_response(kept, timeout_s=10)) == 400  # neither field
            await kept.send(half)
            sent_half = anyio.current_time()
            assert await read_until_closed(kept, timeout_s=10) == b""
            assert anyio.current_time() - sent_half < 4  # the header deadline, not keep-alive


async def test_usage_in_a_callbacks_result_is_recorded_and_charged(conn: Connection) -> None:
    """An async agent reports what the work used as ``usage`` at the top of the result it
    POSTs back: the callback that settles the message charges it — on the record, the
    timeline of the ending, and the agent's, capability's and tenant's figures — with the
    time from the agent's acceptance to its callback; a failure reports its usage beside the
    error; a result without usage is charged a request and no usage."""
    used = {"input_tokens": 1500, "output_tokens": 250, "cost": 0.375}
    spent = {"input_tokens": 10, "cost": 0.125}  # beside the error: a failure used this
    async with (
        async_agent() as agent,
        running_dispatcher(conn),
        async_sidecar(conn, agent),
        Client(conn) as client,
    ):
        reply_to = client.new_reply_stream()
        began = anyio.current_time()
        ids = {
            name: await client.submit(envelope(reply_to, name, tenant=tenant))
            for name, tenant in (("billed", "team-a"), ("free", "team-a"), ("failed", "team-b"))
        }
        for message_id in ids.values():
            await taken_by_agent(agent, conn, message_id)
        answers = [
            await agent.call_back(ids["billed"], {"result": {"summary": "ok", "usage": used}}),
            await agent.call_back(ids["free"], {"result": {"summary": "ok"}}),
            await agent.call_back(ids["failed"], {"error": "could not think", "usage": spent}),
        ]
        replies = await collect_replies(conn, reply_to, 3)
        took_ms = (anyio.current_time() - began) * 1000

    assert [a.status for a in answers] == [200, 200, 200]
    billed = replies[ids["billed"]]
    assert billed.stage is Stage.SUCCEEDED and billed.result == {"summary": "ok", "usage": used}
    assert replies[ids["failed"]].stage is Stage.FAILED
    stored = await conn.call("HGET", conn.keys.record(ids["billed"]), "usage:1")
    assert stored is not None and json.loads(stored) == used
    timeline = await MessageStore(conn).get_timeline(ids["billed"])
    assert [str(e.stage) for e in timeline][-2:] == ["CALLBACK_RECEIVED", "SUCCEEDED"]
    said = "usage in=1500 out=250 cost=0.375"
    assert said in timeline[-1].reason and sum(said in e.reason for e in timeline) == 1
    assert await conn.call("HGET", conn.keys.record(ids["free"]), "usage:1") is None
    entries = await MessageStore(conn).get_timeline(ids["free"])
    assert not any("usage in=" in e.reason for e in entries), entries
    stored = await conn.call("HGET", conn.keys.record(ids["failed"]), "usage:1")
    assert stored is not None and json.loads(stored) == spent

    expected = {
        "requests": 3,
        "succeeded": 2,
        "failed": 1,
        "retried": 0,
        "reported": 2,
        "input_tokens": 1510,
        "output_tokens": 250,
        "cost": 0.5,
    }
    for by, name in (("agent", "thinker"), ("capability", "text.think")):
        [row] = await usage_lately(conn, by)
        figures = row.as_json()
        assert figures["name"] == name
        assert {k: figures[k] for k in expected} == expected, figures
        # acceptance to callback, for each of the three (awaited at once: summed, they may
        # be more than the time the test took, never more than three times it)
        assert 0 <= figures["busy_ms"] <= 3 * took_ms + 2
    tenants = {r.name: r.as_json() for r in await usage_lately(conn, "tenant")}
    assert (tenants["team-a"]["requests"], tenants["team-a"]["cost"]) == (2, 0.375)
    assert (tenants["team-b"]["failed"], tenants["team-b"]["cost"]) == (1, 0.125)
