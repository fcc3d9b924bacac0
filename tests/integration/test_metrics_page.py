"""The metrics page as rendered, and the Grafana dashboard's queries against it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from broker.connection import Connection
from workers.metrics_page import render

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
