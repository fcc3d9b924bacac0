"""Agent-signalled back-off and the failure paths around it, with real agents and Redis."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.connection import Connection
from broker.envelope import Envelope
from broker.metric_fields import read_counters
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import (
    collect_replies,
    eventually,
    keys_matching,
    running_dispatcher,
    running_sidecar,
)
from workers.dispatcher import Dispatcher


def echo(reply_to: str, **fields: object) -> Envelope:
    raw = msgspec.json.encode({"capability": "text.echo", "reply_to": reply_to, **fields})
    return msgspec.json.decode(raw, type=Envelope)


async def test_429_with_retry_after_is_not_a_failure_and_the_message_completes_later(
    conn: Connection,
) -> None:
    seen: dict[str, int] = {}

    async def busy_once(envelope: dict[str, object], request: Request) -> Response | None:
        message_id = request.headers["x-reach-message-id"]
        seen[message_id] = seen.get(message_id, 0) + 1
        if seen[message_id] == 1:
            return JSONResponse(
                {"detail": "slow down"}, status_code=429, headers={"Retry-After": "1"}
            )
        return None

    client = Client(conn)
    reply_to = client.new_reply_stream()
    async with (
        http_agent("a", behaviour=busy_once) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url, max_inflight=4),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(echo(reply_to))
        (result,) = (await collect_replies(conn, reply_to, 1, timeout_s=20)).values()
        card = await conn.call(
            "HMGET", conn.keys.card("a-1"), "error_rate", "backoff_until_ms", "credits"
        )
    assert result.stage is Stage.SUCCEEDED and result.id == message_id
    assert agent.log.calls[message_id] == 2
    timeline = await MessageStore(conn).get_timeline(message_id)
    stages = [e.stage for e in timeline]
    assert Stage.FAILED not in stages and stages.count(Stage.PROCESSING) == 2
    waited = timeline[stages.index(Stage.WAITING)]
    assert "429" in waited.reason and "retry after 1 s" in waited.reason
    second_try = timeline[len(stages) - 1 - stages[::-1].index(Stage.ROUTED)]
    assert second_try.ts_ms - waited.ts_ms >= 900  # not back to it before Retry-After
    assert float(card[0]) == 0.0  # the agent's error rate was not charged
    assert int(card[1]) > 0
    assert int(card[2]) < 4  # "too busy" cut the credit limit (halved, not yet regrown)
    retries = read_counters(await conn.read_counters())["retries"]
    assert retries == {("text.echo", "backpressure"): 1}  # the requeue counted as a retry


async def test_bare_503_is_ambiguous_so_a_non_idempotent_message_is_parked(
    conn: Connection,
) -> None:
    async def gateway_503(envelope: dict[str, object], request: Request) -> Response | None:
        return Response(status_code=503)  # no Retry-After: maybe the agent acted, maybe not

    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    async with (
        http_agent("a", behaviour=gateway_503) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        message_id = await client.submit(echo(reply_to))

        async def parked() -> bool:
            record = await store.get_record(message_id)
            return record is not None and record.stage is Stage.NEEDS_CONFIRMATION

        await eventually(parked)
    assert agent.log.calls[message_id] == 1  # never run again on a guess


async def test_an_undeliverable_reply_is_dead_lettered_and_the_sidecar_lives_on(
    conn: Connection,
) -> None:
    client = Client(conn)
    bad_reply = conn.keys.reply("not-a-stream")
    await conn.call("SET", bad_reply, "a string, not a stream")
    good_reply = client.new_reply_stream()
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        lost = await client.submit(echo(bad_reply))
        after = await client.submit(echo(good_reply))
        results = await collect_replies(conn, good_reply, 1)
        letters = await conn.call("XRANGE", conn.keys.dlq, "-", "+")
    assert results[after].stage is Stage.SUCCEEDED  # the sidecar kept going
    reasons = {dict(zip(f[::2], f[1::2], strict=True))[b"id"].decode(): f for _, f in letters}
    assert lost in reasons and b"reply_undeliverable" in b" ".join(reasons[lost])
    assert int(await conn.call("SCARD", conn.keys.inflight("a-1"))) == 0  # credit returned
    assert agent.log.total == 2


async def test_a_raw_entry_handled_twice_is_one_message(conn: Connection) -> None:
    """A dispatcher that restarts mid-batch handles its pending entries again: a raw XADD
    without an id must map to the same message, not run twice under two ids."""
    reply_to = conn.keys.reply("raw")
    raw = msgspec.json.encode({"capability": "text.echo", "reply_to": reply_to})
    async with http_agent("a") as agent:
        await conn.call("XGROUP", "CREATE", conn.keys.ingress, "dispatch", "0", "MKSTREAM")
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", raw)
        # a dispatcher took the entry and died before acknowledging it
        reply = await conn.call(
            "XREADGROUP", "GROUP", "dispatch", "d1", "COUNT", 10, "STREAMS", conn.keys.ingress, ">"
        )
        ((entry_id, flat),) = reply[0][1]
        entry = (entry_id.decode(), flat)
        await Dispatcher(conn, consumer="d1").handle_batch([entry])  # first handling
        async with (
            running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
            running_dispatcher(conn, "d2"),  # drains what waits
        ):
            await Dispatcher(conn, consumer="d1").handle_batch([entry], recovering=True)
            results = await collect_replies(conn, reply_to, 1)
            await client_trace_settles(conn)
    assert len(results) == 1 and agent.log.total == 1
    records = await keys_matching(conn, conn.keys.record("*"))
    assert len(records) == 1  # one message, not two


async def client_trace_settles(conn: Connection) -> None:
    """Give a second copy, if there were one, the time to run: the queue must stay empty."""

    async def quiet() -> bool:
        return int(await conn.call("SCARD", conn.keys.inflight("a-1"))) == 0

    await eventually(quiet)
