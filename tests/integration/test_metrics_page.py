"""The metrics page as rendered, and the Grafana dashboard's queries against it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.metric_fields import NEEDS_CONFIRMATION_LEVEL
from broker.registry import Registry
from broker.stats import backlog_stats
from tests.support.harness import card
from workers.metrics_page import render
from workers.overview import rates_between, read_overview

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "agent-reach.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
ISSUE_NAMES = {
    "agent_reach_messages_accepted_total",
    "agent_reach_messages_finished_total",
    "agent_reach_retries_total",
    "agent_reach_dead_letters_total",
    "agent_reach_agent_calls_total",
    "agent_reach_webhook_deliveries_total",
    "agent_reach_queue_wait_seconds_bucket",
    "agent_reach_agent_call_duration_seconds_bucket",
    "agent_reach_end_to_end_seconds_bucket",
    "agent_reach_routing_decision_seconds_bucket",
    "agent_reach_waiting_messages",
    "agent_reach_oldest_waiting_age_seconds",
    "agent_reach_credits_in_use",
    "agent_reach_credits_limit",
    "agent_reach_instance_state",
    "agent_reach_instance_reach_score",
    "agent_reach_circuit_open",
    "agent_reach_dlq_entries",
    "agent_reach_needs_confirmation_messages",
    "agent_reach_build_info",
}


async def served_names(conn: Connection) -> set[str]:
    """Every series name the page can hold, from its families and their types."""
    page = (await render(conn)).decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(page):
        suffixes = SUFFIXES.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


async def test_the_page_holds_every_metric_by_its_name(conn: Connection) -> None:
    assert ISSUE_NAMES <= await served_names(conn)


async def test_every_metric_the_dashboard_queries_is_served(conn: Connection) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"agent_reach_[a-z_]+", target["expr"])
    }
    assert len(queried) >= 15, "the dashboard shows the broker, not a corner of it"
    assert queried <= await served_names(conn)


async def test_counters_no_script_writes_are_passed_over_on_every_page(conn: Connection) -> None:
    """Anyone who may write counters (a sidecar's user may) may write any value. A count of
    5,000 digits failed `int`; one of 400 failed the float of a rate: the console's reading
    raised, which ended the console and the roles run beside it."""
    counters = conn.keys.counters
    for capability, value in (("a.b", "9" * 5000), ("c.d", "9" * 400), ("e.f", "7")):
        await conn.call("HSET", counters, f"accepted\t{capability}", value)
    await conn.call("HSET", counters, NEEDS_CONFIRMATION_LEVEL, "9" * 5000)
    await conn.call("SADD", conn.keys.waiting_index, b"\xff\xfe.bad")

    first = await read_overview(conn)
    later = await read_overview(conn)
    page = (await render(conn)).decode()

    assert first.totals["accepted"] == 7 and first.needs_confirmation == 0
    assert (
        rates_between(first.at_ms, first.totals, first.at_ms + 1000, later.totals)["accepted"] == 0
    )
    assert re.search(
        r'^agent_reach_messages_accepted_total\{.*capability="e\.f".*\} 7\.0$', page, re.M
    )
    assert 'capability="a.b"' not in page and 'capability="c.d"' not in page


async def test_capabilities_past_the_series_cap_are_one_other_row(settings: Settings) -> None:
    """Anyone who may send work may name any number of capabilities: with 15,000 made up,
    the page held 30,000 waiting series and the console read each one every second. Past
    `metrics_max_series` the shallowest are summed in one `_other` row, not looked at."""
    capped = msgspec.structs.replace(settings, metrics_max_series=10)
    assert capped.redis_url is not None
    async with open_connection(capped, capped.redis_url) as conn:
        names = [f"made.up{n:02d}" for n in range(15)]
        for depth, name in enumerate(names, start=1):  # made.up14 the deepest
            members = [x for i in range(depth) for x in (i, f"{name}-{i}")]
            await conn.call("ZADD", conn.keys.waiting(name), *members)
        await conn.call("SADD", conn.keys.waiting_index, *names)

        stats = await backlog_stats(conn, most=10)
        page = (await render(conn)).decode()

    rows = {row.capability: row for row in stats.capabilities}
    assert sorted(rows) == ["_other", *names[5:]]
    assert rows["_other"].waiting == sum(range(1, 6)) and rows["_other"].oldest_waiting_s is None
    assert rows["made.up14"].waiting == 15 and rows["made.up14"].oldest_waiting_s is not None
    waiting = re.findall(r"^agent_reach_waiting_messages\{", page, re.M)
    oldest = re.findall(r"^agent_reach_oldest_waiting_age_seconds\{", page, re.M)
    assert (len(waiting), len(oldest)) == (11, 10)
    assert 'agent_reach_waiting_messages{capability="_other"} 15.0' in page


async def test_a_served_capability_is_never_folded_and_a_spoiled_stream_reads_as_empty(
    conn: Connection,
) -> None:
    """Made-up names deeper than a served capability folded it into `_other`, out of its
    own series; a sidecar's user who made its work stream another type failed the reading:
    /metrics answered 500 and the console had a gap every second."""
    await Registry(conn).register(card("a-1", ("text.echo",)), credits=4)
    await conn.call("DEL", conn.keys.queue("a-1"))
    await conn.call("SET", conn.keys.queue("a-1"), "x")
    for name in ("made.up1", "made.up2", "made.up3"):
        await conn.call("ZADD", conn.keys.waiting(name), 1, f"{name}-1", 2, f"{name}-2")
        await conn.call("SADD", conn.keys.waiting_index, name)

    stats = await backlog_stats(conn, most=2)
    page = (await render(conn)).decode()

    assert [row.capability for row in stats.capabilities] == ["made.up1", "text.echo", "_other"]
    assert [(i.instance_id, i.stream) for i in stats.instances] == [("a-1", 0)]
    assert 'agent_reach_waiting_messages{capability="text.echo"} 0.0' in page
    # a card may list any number of capabilities: served first, but never past the cap
    many = tuple(f"served.n{n:02d}" for n in range(50))
    await Registry(conn).register(card("b-1", many), credits=1)
    rows = [row.capability for row in (await backlog_stats(conn, most=10)).capabilities]
    assert len(rows) == 11 and rows[-1] == "_other" and "made.up1" not in rows
