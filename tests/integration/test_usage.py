"""Usage and cost accounting on a real Redis, with real HTTP agents: what agents report is
charged per attempt in the script that records the attempt, per agent, capability and tenant
of the UTC day, and read back by ``agent-reach usage``."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner, Result
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client, SyncClient
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.feedback import record_feedback
from broker.governance import TenantBudget
from broker.stages import Stage
from broker.store import Acceptance, MessageStore, Move, usage_keys
from broker.timekeeping import now_ms
from broker.usage import Usage, charge, utc_day
from broker.usage_reader import day_hashes, tenant_spending
from tests.support.agents import http_agent
from tests.support.harness import running_dispatcher, running_sidecar
from tests.support.usage_days import DAY_MS, day_turned, spending_lately, usage_lately
from workers.cli import main
from workers.metrics_page import cluster_families


async def cli(*args: str) -> Result:
    return await anyio.to_thread.run_sync(lambda: CliRunner().invoke(main, list(args)))


def _acceptance(message_id: str) -> Acceptance:
    return Acceptance(
        message_id=message_id,
        envelope_json=b"{}",
        capability="text.echo",
        deadline_ms=now_ms() + 60_000,
        reply_to="",
        priority=0,
        next_stage=Stage.ROUTED,
        accepted_ms=now_ms(),
        instance="a-1",
    )


def _bill(tenant: str | None, attempt: int = 1, cost: float = 0.25, ms: int = 0) -> Any:
    """A charge at ``ms`` (default: now), which picks the day and month it goes to."""
    return charge(
        "a",
        "text.echo",
        tenant,
        attempt=attempt,
        answered=True,
        busy_ms=12.4,
        usage=Usage(input_tokens=100, output_tokens=20, cost=cost),
        ms=ms or now_ms(),
    )


async def test_a_charge_is_written_once_with_the_move_that_records_it(conn: Connection) -> None:
    store = MessageStore(conn)
    await store.accept(_acceptance("u1"))
    await store.move("u1", Stage.RECEIVED)
    await store.move("u1", Stage.PROCESSING)
    done = Move("u1", Stage.SUCCEEDED, only_from=Stage.PROCESSING, charge=_bill("team-a"))
    assert (await store.apply(done)).ok
    assert not (await store.apply(done)).ok  # a repeat moves nothing and charges nothing
    [row] = await usage_lately(conn, "tenant")
    assert row.name == "team-a"
    assert row.as_json() == {
        "name": "team-a",
        "requests": 1,
        "succeeded": 1,
        "failed": 0,
        "retried": 0,
        "busy_ms": 12,
        "reported": 1,
        "input_tokens": 100,
        "output_tokens": 20,
        "cost": 0.25,
    }
    day, month = await spending_lately(conn)
    assert day == month == {"team-a": 0.25}


async def test_a_test_reads_usage_charged_before_a_utc_midnight(conn: Connection) -> None:
    """The suite's reading (tests/support/usage_days.py) finds a charge of the day before,
    which a reading of today alone misses: a test that runs across midnight still reads its
    own charges."""
    store = MessageStore(conn)
    now = now_ms()
    await store.accept(_acceptance("y1"))
    late = Move("y1", Stage.CANCELLED, charge=_bill("team-y", cost=0.5, ms=now - DAY_MS))
    assert (await store.apply(late)).ok
    assert (await tenant_spending(conn, now))[0] == {}
    assert await spending_lately(conn, now) == ({"team-y": 0.5}, {"team-y": 0.5})
    assert [row.name for row in await usage_lately(conn, "tenant", now)] == ["team-y"]


async def test_whole_amounts_add_as_integers_and_a_fraction_or_an_overflow_as_floats(
    conn: Connection,
) -> None:
    """Whole counts go as digits (``HINCRBY``); a field that holds a fraction, or would
    overflow, still takes them (``HINCRBYFLOAT``); a figure of 0 writes nothing."""
    store = MessageStore(conn)
    now = now_ms()  # the charge's time, and so its day
    day = usage_keys(conn, now, conn.keys.record("w1"))[0]
    combination = "a\ttext.echo\tteam-w\t"
    await conn.call_many(
        [
            ("HSET", day, combination + "requests", "0.5"),
            ("HSET", day, combination + "succeeded", str(2**63 - 1)),  # no more fits
        ]
    )
    await store.accept(_acceptance("w1"))  # one message: a cluster keeps usage per slot
    await store.move("w1", Stage.RECEIVED)
    await store.move("w1", Stage.PROCESSING)
    bill = charge(
        "a", "text.echo", "team-w", attempt=1, answered=True, busy_ms=0.2, usage=None, ms=now
    )
    done = Move("w1", Stage.SUCCEEDED, only_from=Stage.PROCESSING, charge=bill)
    assert (await store.apply(done)).ok
    fields = await conn.call("HGETALL", day)
    written = dict(zip(fields[::2], fields[1::2], strict=True))
    assert float(written[(combination + "requests").encode()]) == 1.5
    overflown = written[(combination + "succeeded").encode()]
    # past the integers' range, added as a float: not the 2**63 - 1 a lost amount leaves
    assert overflown != str(2**63 - 1).encode() and float(overflown) == 2**63
    assert (combination + "busy_ms").encode() not in written  # 0.2 ms rounds to 0


async def test_usage_hashes_are_kept_for_their_days_from_the_first_charge(
    conn: Connection,
) -> None:
    """A day's hash is given its expiry when it is first charged (a new combination), and
    later charges of that combination leave it; the month's, whenever spending goes to it.
    Neither is ever left without one."""
    store = MessageStore(conn)
    keep_s = max(conn.settings.usage_keep_days, 32) * 86400
    now = now_ms()
    day, month = usage_keys(conn, now, conn.keys.record("k0"))
    # on a cluster each slot charges its own copies: three messages charging the same ones
    near = (f"k{n}" for n in itertools.count())
    same = (i for i in near if usage_keys(conn, now, conn.keys.record(i)) == (day, month))
    k0, k1, k2 = itertools.islice(same, 3)

    async def charged(message_id: str, cost: float) -> list[int]:
        await store.accept(_acceptance(message_id))
        move = Move(message_id, Stage.CANCELLED, charge=_bill("t", cost=cost, ms=now))
        assert (await store.apply(move)).ok
        return [int(await conn.call("TTL", key)) for key in (day, month)]

    first = await charged(k0, 0.0)  # no spending: the month's hash is not written
    assert 0 < first[0] <= keep_s and first[1] == -2, first
    spent = await charged(k1, 0.5)
    assert 0 < spent[0] <= keep_s and 0 < spent[1] <= keep_s, spent
    await conn.call("EXPIRE", day, 1000)  # as if first charged long ago
    again = await charged(k2, 0.0)
    assert 0 < again[0] <= 1000, again


async def test_new_combinations_past_the_cap_are_charged_as_other(settings: Settings) -> None:
    capped = msgspec.structs.replace(settings, metrics_max_series=10)  # 40 usage fields
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn:
        store = MessageStore(conn)
        for i in range(30):  # a producer naming a new tenant each time
            await store.accept(_acceptance(f"c{i}"))
            move = Move(f"c{i}", Stage.CANCELLED, charge=_bill(f"t{i}", cost=1.0))
            assert (await store.apply(move)).ok
        # the cap, and one "~other" combination's fields: per hash (on a cluster, per slot)
        now = now_ms()  # the charges' day, or the one after: both are read
        for found in await day_hashes(conn, [utc_day(now - DAY_MS), utc_day(now)]):
            assert len(found) <= 40 + 8
        rows = {row.name: row for row in await usage_lately(conn, "tenant")}
        assert sum(row.figures["requests"] for row in rows.values()) == 30
        if not conn.cluster:  # one hash: it filled, and the rest went to "~other"
            assert rows["~other"].figures["requests"] > 0
        day, _ = await spending_lately(conn)
        assert sum(day.values()) == 30.0


async def _reporting_agent(envelope: dict[str, Any], request: Request) -> Response:
    payload = envelope.get("payload") or {}
    await anyio.sleep(payload.get("work_ms", 0) / 1000)  # the agent's work: busy time
    if payload.get("how") == "headers":
        headers = {"X-Reach-Usage": "input_tokens=7, output_tokens=3", "X-Reach-Cost": "0.5"}
        return JSONResponse({"ok": True}, headers=headers)
    if payload.get("how") == "garbage":
        headers = {"X-Reach-Usage": "{not json", "X-Reach-Cost": "-3"}
        return JSONResponse({"usage": {"input_tokens": "many", "cost": 1e300}}, headers=headers)
    if payload.get("how") == "fail":
        return JSONResponse({"error": "boom"}, status_code=500, headers={"X-Reach-Cost": "0.125"})
    usage = {"input_tokens": 40, "output_tokens": 60, "cost": 0.25}
    return JSONResponse({"answer": 42, "usage": usage})


async def test_agents_report_usage_in_the_body_and_headers(conn: Connection) -> None:
    async with (
        http_agent("billing", behaviour=_reporting_agent) as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "bill-1", ("text.echo",), url=agent.url),
        Client(conn) as client,
    ):
        charged_ms = now_ms()  # the charges are made from here on
        body = await client.request("text.echo", {"how": "body", "work_ms": 40}, tenant="team-a")
        heads = await client.request("text.echo", {"how": "headers"}, tenant="team-a")
        junk = await client.request("text.echo", {"how": "garbage"}, tenant="team-b")
        failed = await client.request("text.echo", {"how": "fail"}, max_attempts=1)
    assert body.ok and heads.ok and junk.ok and not failed.ok
    record = await MessageStore(conn).get_record(body.id)
    assert record is not None
    stored = await conn.call("HGET", conn.keys.record(body.id), "usage:1")
    assert json.loads(stored) == {"input_tokens": 40, "output_tokens": 60, "cost": 0.25}
    timeline = await MessageStore(conn).get_timeline(body.id)
    assert any("usage in=40 out=60 cost=0.25" in entry.reason for entry in timeline)
    assert await conn.call("HGET", conn.keys.record(junk.id), "usage:1") is None

    by_tenant = {r.name: r.as_json() for r in await usage_lately(conn, "tenant")}
    assert by_tenant["team-a"]["requests"] == 2
    assert by_tenant["team-a"]["input_tokens"] == 47
    assert by_tenant["team-a"]["output_tokens"] == 63
    assert by_tenant["team-a"]["cost"] == 0.75
    assert by_tenant["team-b"] == {**by_tenant["team-b"], "requests": 1, "cost": 0, "reported": 0}
    assert by_tenant["-"]["failed"] == 1 and by_tenant["-"]["cost"] == 0.125
    [by_agent] = await usage_lately(conn, "agent")
    assert (by_agent.name, by_agent.figures["requests"]) == ("bill", 4)
    assert by_agent.figures["busy_ms"] >= 40  # the one call that worked 40 ms, at least

    families = {f.name: f for f in await cluster_families(conn)}
    cost = {
        tuple(s.labels.values()): s.value for s in families["agent_reach_usage_cost_today"].samples
    }
    found = cost.get(("bill", "text.echo", "team-a"), 0.0)
    if day_turned(charged_ms):  # today's by definition: some of the charges may be yesterday's
        assert 0.0 <= found <= 0.75
    else:
        assert found == 0.75


async def test_a_retried_message_is_charged_per_attempt_and_says_so(conn: Connection) -> None:
    calls = {"n": 0}

    async def flaky(envelope: dict[str, Any], request: Request) -> Response:
        calls["n"] += 1
        usage = {"input_tokens": 10, "output_tokens": 1, "cost": 0.01}
        if calls["n"] == 1:
            return JSONResponse({"error": "try later", "usage": usage}, status_code=503)
        return JSONResponse({"done": True, "usage": usage})

    async with (
        http_agent("retry", behaviour=flaky) as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "retry-1", ("text.echo",), url=agent.url, idempotent=True),
        running_sidecar(conn, "retry-2", ("text.echo",), url=agent.url, idempotent=True),
        Client(conn) as client,
    ):
        result = await client.request("text.echo", {}, tenant="t-retry", max_attempts=3, timeout=10)
    assert result.ok and calls["n"] == 2
    [row] = await usage_lately(conn, "capability")
    figures = row.as_json()
    assert (figures["requests"], figures["failed"], figures["succeeded"]) == (2, 1, 1)
    assert figures["retried"] == 1
    # each attempt that reported usage is charged for it: the refusal (503) as well
    assert (figures["input_tokens"], figures["output_tokens"]) == (20, 2)
    assert figures["cost"] == pytest.approx(0.02)
    charged = await conn.call("HMGET", conn.keys.record(result.id), "usage:1", "usage:2")
    assert all(charged)  # each attempt's usage on the record

    where = ("--redis", conn.url, "--prefix", conn.keys.prefix)
    printed = await cli("usage", "--by", "tenant", "--since", "2d", *where)
    assert printed.exit_code == 0, printed.output
    assert "t-retry" in printed.output and "were retries" in printed.output
    for by, name in (("capability", "text.echo"), ("agent", "retry")):
        shown = await cli("usage", "--by", by, "--since", "2d", *where)
        assert shown.exit_code == 0 and name in shown.output, shown.output
    as_json = await cli(
        "usage", "--json", "--since", "7d", "--redis", conn.url, "--prefix", conn.keys.prefix
    )
    document = json.loads(as_json.output)
    assert document["days"] == 7 and document["rows"][0]["name"] == "retry"
    bad = await cli("usage", "--since", "forever", "--redis", conn.url)
    assert bad.exit_code == 2 and "a span like 7d" in bad.output


async def test_the_agent_is_recorded_with_the_outcome_so_feedback_outlives_its_card(
    conn: Connection,
) -> None:
    async with (
        http_agent("rated") as agent,
        running_dispatcher(conn),
        Client(conn) as client,
    ):
        async with running_sidecar(conn, "rated-1", ("text.echo",), url=agent.url):
            result = await client.request("text.echo", {})
        assert result.ok
        assert await conn.call("DEL", conn.keys.card("rated-1")) == 1  # forgotten, gone
        assert await record_feedback(conn, result.id, good=False) == "rated"
        assert await client.feedback(result.id, good=True) == "rated"

        def rate_blocking() -> str:
            with SyncClient(settings=conn.settings) as sync:
                return sync.feedback(result.id, good=False)

        assert await anyio.to_thread.run_sync(rate_blocking) == "rated"
        ratings = await conn.call("LRANGE", conn.fleet.feedback("rated"), 0, -1)
        assert [r.split(b" ")[:2] for r in ratings] == [  # newest first, all three kept
            [b"bad", result.id.encode()],
            [b"good", result.id.encode()],
            [b"bad", result.id.encode()],
        ]


async def test_a_budgeted_tenants_spending_is_kept_past_the_cap(settings: Settings) -> None:
    capped = msgspec.structs.replace(
        settings, metrics_max_series=10, budgets={"team-a": TenantBudget(daily=1.0)}
    )
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn:
        store = MessageStore(conn)
        for i in range(40):  # a flood of junk tenants fills the day's hash (every slot's)
            await store.accept(_acceptance(f"j{i}"))
            assert (await store.apply(Move(f"j{i}", Stage.CANCELLED, charge=_bill(f"junk{i}")))).ok
        await store.accept(_acceptance("paid"))
        assert (await store.apply(Move("paid", Stage.CANCELLED, charge=_bill("team-a", cost=5)))).ok
        day, month = await spending_lately(conn)
    assert day["team-a"] == month["team-a"] == 5.0
