"""An outcome whose record was spoiled while its call ran (a key of another type, which anyone
allowed to write records can make): the finisher dead-letters it and returns its credit, and
every other outcome is recorded, told and released — where one such record used to be
written again for ever, with every outcome queued behind it (adapters/dropping.py). A spoiled
counter is no spoiled record: the move is made all the same (lua/move_record.lua)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest

from adapters.outcome import Succeeded
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope
from broker.governance import TenantBudget
from broker.keyspace import SIDECAR_GROUP
from broker.stages import Stage
from broker.store import MessageStore, Move, usage_keys
from broker.timekeeping import now_ms
from broker.usage import Charge
from broker.usage_reader import tenant_spending
from tests.support.harness import (
    collect_replies,
    dead_letters,
    eventually,
    running_dispatcher,
    running_sidecar,
)
from tests.support.repair import record_in


class GatedAgent:
    """A transport whose calls all wait for one gate; ``arrived`` is set once ``expected``
    calls wait there."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.calls: list[str] = []
        self.arrived = anyio.Event()
        self.gate = anyio.Event()

    async def deliver(self, envelope: Envelope, attempt: int) -> Succeeded:
        self.calls.append(envelope.message_id)
        if len(self.calls) == self.expected:
            self.arrived.set()
        await self.gate.wait()
        return Succeeded(b"{}")

    async def aclose(self) -> None:
        pass


@asynccontextmanager
async def calls_at_the_gate(
    conn: Connection, reply_to: str, count: int
) -> AsyncIterator[tuple[GatedAgent, Client, list[str]]]:
    """Sidecar a-1 (a :class:`GatedAgent`) and a dispatcher; ``count`` messages sent, their
    calls all waiting at the gate. Yields the agent, the producer's client and the ids."""
    agent = GatedAgent(count)
    async with (
        running_sidecar(conn, "a-1", ("text.echo",), transport=agent),
        running_dispatcher(conn),
    ):
        client = Client(conn)
        echo = Envelope(capability="text.echo", reply_to=reply_to)
        sent = await client.submit_many([echo] * count)  # each given its own id
        with anyio.fail_after(10):
            await agent.arrived.wait()
        yield agent, client, sent


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("ending_together", [1, 3])
async def test_an_outcome_whose_record_was_spoiled_meanwhile_is_dead_lettered(
    conn: Connection, ending_together: int
) -> None:
    """``ending_together`` calls end at once, one of them on a spoiled record: a round of one
    outcome (recorded, told and released in one round trip) or of several (three). Then one
    more message runs through the same sidecar."""
    reply_to = conn.keys.reply("spoiled")
    queue, inflight = conn.keys.queue("a-1"), conn.keys.inflight("a-1")
    store = MessageStore(conn)
    async with calls_at_the_gate(conn, reply_to, ending_together) as (agent, client, sent):
        spoiled, *sound = sent
        await conn.call("DEL", conn.keys.record(spoiled))
        await conn.call("SET", conn.keys.record(spoiled), "x")
        agent.gate.set()  # every call ends in the same turn of the sidecar's loop

        async def settled() -> bool:
            credits = int(await conn.call("SCARD", inflight))
            return credits == 0 and (await conn.call("XPENDING", queue, SIDECAR_GROUP))[0] == 0

        await eventually(settled, timeout_s=10)  # before anything else ends on this sidecar
        after = await client.submit(Envelope(capability="text.echo", reply_to=reply_to))
        told = await collect_replies(conn, reply_to, len(sound) + 2, timeout_s=20)
        await eventually(settled, timeout_s=10)
    assert set(told) == {spoiled, *sound, after}
    assert all(told[m].stage is Stage.SUCCEEDED for m in [*sound, after])
    assert await store.stages([*sound, after]) == [Stage.SUCCEEDED] * (len(sound) + 1)
    (letter,) = [x for x in await dead_letters(conn) if spoiled.encode() in x["raw"]]
    reason = letter["reason"].decode()
    assert reason.startswith("unusable_record: ") and "WRONGTYPE" in reason
    # its producer is told it ended, and why, as the dead letter says: not left waiting
    assert told[spoiled].stage is Stage.DEAD and told[spoiled].error == reason
    assert sorted(agent.calls) == sorted([*sent, after])


@pytest.mark.anyio
@pytest.mark.parametrize("ending_together", [1, 3])
async def test_a_spoiled_counter_costs_its_count_not_the_outcomes(
    conn: Connection, ending_together: int
) -> None:
    """A counters field that is no number (every sidecar's Redis user may write the
    counters): the terminal moves that count into it are made, answered as made, the
    records get their expiry, and every producer is told — where the move's script failed
    after it had written the record, and the finisher took the record for spoiled."""
    await conn.call("HSET", conn.keys.counters, "finished\ttext.echo\tSUCCEEDED", "x")
    reply_to = conn.keys.reply("counted")
    store = MessageStore(conn)
    async with calls_at_the_gate(conn, reply_to, ending_together) as (agent, _, sent):
        agent.gate.set()
        told = await collect_replies(conn, reply_to, ending_together, timeout_s=20)
    assert set(told) == set(sent)
    assert await store.stages(sent) == [Stage.SUCCEEDED] * ending_together
    assert all([int(await conn.call("TTL", conn.keys.record(m))) > 0 for m in sent])
    assert not [x for x in await dead_letters(conn) if b"unusable_record" in x["reason"]]


SPOILED_USAGE = {  # what someone spoiled -> what is still charged (today's spend, the month's)
    "nothing": (5.0, 5.0),
    "the month's hash": (5.0, None),
    "the day's hash": (None, 5.0),
    "a figure of the day": (5.0, 5.0),
}


@pytest.mark.anyio
@pytest.mark.parametrize("spoiled", SPOILED_USAGE)
async def test_a_spoiled_usage_key_loses_its_own_charge_not_the_move_nor_the_others(
    settings: Settings, spoiled: str
) -> None:
    """A move that charges an attempt's usage (tenant ``acme`` has a budget): a usage hash
    of another type, or a figure in it that is no number, loses the charges that go to that
    hash alone. The spend (what budgets are enforced on) goes to the day and to the month
    each on its own; the move is made and answered as made. With the day's hash unreadable,
    a tenant without a budget is charged as past the day's cap (``~other``): the month's
    hash does not grow a field per tenant."""
    budgeted = msgspec.structs.replace(settings, budgets={"acme": TenantBudget(monthly=100.0)})
    assert budgeted.redis_url is not None
    async with open_connection(budgeted, budgeted.redis_url) as conn:
        store = MessageStore(conn)
        ms = now_ms()
        spent = []
        for tenant in ("acme", "unbudgeted"):
            message_id = await record_in(conn, Stage.PROCESSING, instance="a-1")
            day, month = usage_keys(conn, ms, conn.keys.record(message_id))
            if spoiled == "the month's hash":
                await conn.call("SET", month, "x")
            elif spoiled == "the day's hash":
                await conn.call("SET", day, "x")
            elif spoiled == "a figure of the day":
                await conn.call("HSET", day, f"agent\ttext.echo\t{tenant}\trequests", "x")
            bill = Charge("agent", "text.echo", tenant, ms, {"requests": 1, "cost": 5.0})
            move = Move(
                message_id, Stage.SUCCEEDED, expect_attempt=1, expect_instance="a-1", charge=bill
            )
            moved = await store.apply(move)
            assert moved.ok and moved.stage is Stage.SUCCEEDED
            today, this_month = await tenant_spending(conn, ms)
            spent.append((today.get(tenant), this_month.get(tenant)))
            await conn.call("DEL", day, month)
    assert spent[0] == SPOILED_USAGE[spoiled]
    if spoiled == "the day's hash":
        assert spent[1] == (None, None)  # under ~other
