"""Tenant budgets on a real Redis with real HTTP agents: a tenant over its budget is REJECTED
``budget_exhausted`` (or, with ``budget_mode = "cheapest"``, routed to the cheapest capable
instance), and one ``budget.exceeded`` event says so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from click.testing import CliRunner, Result
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.governance import TenantBudget
from broker.stages import Stage
from broker.timekeeping import now_ms
from broker.usage_reader import tenant_spending
from tests.support.agents import http_agent
from tests.support.harness import (
    connected,
    dead_letters,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from workers.cli import main
from workers.dispatcher import Dispatcher


async def _costly(envelope: dict[str, Any], request: Request) -> Response:
    return JSONResponse({"done": True, "usage": {"cost": 0.3}})


@asynccontextmanager
async def governed(settings: Settings, mode: str) -> AsyncIterator[Connection]:
    budgets = {"team-a": TenantBudget(daily=0.5), "team-m": TenantBudget(monthly=100.0)}
    changed = msgspec.structs.replace(
        settings, budgets=budgets, budget_mode=mode, budget_refresh_s=0.01
    )
    async with connected(changed) as conn:
        yield conn


async def past_the_refresh(conn: Connection, dispatcher: Dispatcher, tenant: str) -> None:
    """The spending is charged before the answer is sent; a dispatcher's view of it may be
    ``budget_refresh_s`` old (a brake, not an invoice): wait until its view, refreshed as
    admission refreshes it, has the tenant over its budget."""
    spent, month = await tenant_spending(conn, now_ms())
    assert spent[tenant] >= 0.5 or month[tenant] >= 0.5
    budgets = dispatcher.assigner.budgets

    async def sees_it_over() -> bool:
        await budgets.refresh(now_ms())
        return budgets.verdict(tenant) is not None

    await eventually(sees_it_over)


async def knows(dispatcher: Dispatcher, *instances: str) -> None:
    """Until the dispatcher's table holds ``instances``: a card registered before its
    subscription was made reaches it with its next read of the registry, not at once."""

    async def known() -> bool:
        return set(instances) <= {v.instance_id for v in dispatcher.table.instances}

    await eventually(known, timeout_s=10)


async def _cli(*args: str) -> Result:
    return await anyio.to_thread.run_sync(lambda: CliRunner().invoke(main, list(args)))


async def _events(conn: Connection, kind: str) -> list[dict[bytes, bytes]]:
    entries = await conn.call("XRANGE", conn.fleet.events, "-", "+")
    found = [dict(zip(flat[::2], flat[1::2], strict=True)) for _, flat in entries]
    return [e for e in found if e[b"type"] == kind.encode()]


async def announced(conn: Connection) -> list[dict[bytes, bytes]]:
    """The ``budget.exceeded`` events, once there is one: the dispatcher writes it after it
    has told the batch's rejections (or routed the batch), so a reply can come first."""

    async def told() -> bool:
        return bool(await _events(conn, "budget.exceeded"))

    await eventually(told, timeout_s=10)
    return await _events(conn, "budget.exceeded")


async def test_a_tenant_over_its_daily_budget_is_rejected(settings: Settings) -> None:
    async with (
        governed(settings, "reject") as conn,
        http_agent("dear", behaviour=_costly) as agent,
        running_dispatcher(conn) as dispatcher,
        running_sidecar(conn, "dear-1", ("text.echo",), url=agent.url),
        Client(conn) as client,
    ):
        first = await client.request("text.echo", 1, tenant="team-a")
        second = await client.request("text.echo", 2, tenant="team-a")
        assert first.ok and second.ok  # 0.3, then 0.6: over the 0.5 only after the second
        await past_the_refresh(conn, dispatcher, "team-a")
        refused = [await client.request("text.echo", n, tenant="team-a") for n in range(3)]
        other = await client.request("text.echo", 3, tenant="team-m")
        untenanted = await client.request("text.echo", 4)
        events = await announced(conn)
        letters = await dead_letters(conn)
    for result in refused:
        assert result.stage is Stage.REJECTED
        assert result.error is not None and result.error.startswith("budget_exhausted")
        assert "0.6 of its daily budget 0.5" in result.error
    assert other.ok and untenanted.ok
    assert agent.log.total == 4
    [event] = events
    assert event[b"subject"] == b"team-a"
    assert msgspec.json.decode(event[b"detail"]) == {
        "period": "daily",
        "spent": 0.6,
        "budget": 0.5,
        "mode": "reject",
    }
    assert sum(1 for d in letters if d["reason"].startswith(b"budget_exhausted")) == 3


async def test_with_budget_mode_cheapest_an_overspender_goes_to_the_cheapest(
    settings: Settings,
) -> None:
    async with (
        governed(settings, "cheapest") as conn,
        http_agent("dear", behaviour=_costly) as dear,
        http_agent("cheap", behaviour=_costly) as cheap,
        running_dispatcher(conn) as dispatcher,
        running_sidecar(conn, "dear-1", ("text.echo",), url=dear.url, cost=5.0),
        running_sidecar(conn, "cheap-1", ("text.echo",), url=cheap.url, cost=1.0, weight=0.01),
        Client(conn) as client,
    ):
        await knows(dispatcher, "dear-1", "cheap-1")  # both to choose from, from the first
        for n in range(2):  # within budget: the weight keeps the cheap one nearly unused
            assert (await client.request("text.echo", n, tenant="team-a")).ok
        await past_the_refresh(conn, dispatcher, "team-a")
        before = cheap.log.total
        over = [await client.request("text.echo", n, tenant="team-a") for n in range(6)]
        normal = [await client.request("text.echo", n, tenant="team-m") for n in range(6)]
        reason = await conn.call("HGET", conn.keys.record(over[-1].id), "route_reason")
        events = await announced(conn)
        ran_on = [
            await conn.call("HGET", conn.keys.record(r.id), "instance") for r in over + normal
        ]
    assert all(r.ok for r in over + normal)
    assert ran_on[:6] == [b"cheap-1"] * 6  # over its budget: always the cheapest
    # within budget, routing as usual (the weight keeps the cheap one nearly unused)
    assert cheap.log.total - before == ran_on.count(b"cheap-1")
    assert reason.startswith(b"cheapest of 2 (cost 1")
    [event] = events
    assert msgspec.json.decode(event[b"detail"])["mode"] == "cheapest"


async def test_a_tenant_over_its_monthly_budget_is_rejected(settings: Settings) -> None:
    monthly = {"team-mo": TenantBudget(monthly=0.5)}  # no daily budget: the month alone rules
    changed = msgspec.structs.replace(settings, budgets=monthly, budget_refresh_s=0.01)
    async with (
        connected(changed) as conn,
        http_agent("dear", behaviour=_costly) as agent,
        running_dispatcher(conn) as dispatcher,
        running_sidecar(conn, "dear-1", ("text.echo",), url=agent.url),
        Client(conn) as client,
    ):
        for n in range(2):  # 0.3, then 0.6: over the month's 0.5 only after the second
            assert (await client.request("text.echo", n, tenant="team-mo")).ok
        _, month = await tenant_spending(conn, now_ms())
        assert month["team-mo"] == 0.6
        await past_the_refresh(conn, dispatcher, "team-mo")
        refused = await client.request("text.echo", 2, tenant="team-mo")
        events = await announced(conn)
    assert refused.stage is Stage.REJECTED
    assert refused.error is not None and "0.6 of its monthly budget 0.5" in refused.error
    assert agent.log.total == 2
    [event] = events
    assert msgspec.json.decode(event[b"detail"])["period"] == "monthly"


async def test_send_carries_tenant_and_budget_per_task_from_the_command_line(
    settings: Settings,
) -> None:
    async with (
        connected(settings) as conn,
        http_agent("dear") as dear,
        http_agent("cheap") as cheap,
        running_dispatcher(conn),
        running_sidecar(conn, "dear-1", ("text.echo",), url=dear.url, cost=5.0),
        running_sidecar(conn, "cheap-1", ("text.echo",), url=cheap.url, cost=1.0, weight=0.01),
    ):
        common = ["--redis", conn.url, "--prefix", conn.keys.prefix, "--wait", "--timeout", "10"]
        sent = [
            await _cli(
                "send",
                "text.echo",
                "--payload",
                str(n),
                "--tenant",
                "team-cli",
                "--budget-per-task",
                "2",
                *common,
            )
            for n in range(5)
        ]
        ids = [msgspec.json.decode(s.output)["id"] for s in sent]
        records = [
            await conn.call("HMGET", conn.keys.record(i), "instance", "envelope", "route_from")
            for i in ids
        ]
    assert all(s.exit_code == 0 for s in sent), [s.output for s in sent]
    # the dear one is over the budget, whatever its weight: every message went to the cheap one
    assert cheap.log.total == 5 and dear.log.total == 0
    for instance, envelope, route_from in records:
        assert instance == b"cheap-1"
        fields = msgspec.json.decode(envelope)
        assert (fields["tenant"], fields["budget_per_task"]) == ("team-cli", 2.0)
        assert b"cost 5.0 over budget_per_task 2.0" in route_from
