"""``/metrics`` of a real ``agent-reach up`` and a real sidecar, after known traffic, read with
``prometheus_client``'s own parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.config import Settings
from broker.connection import open_connection
from tests.support.agents import http_agent
from tests.support.harness import eventually
from tests.support.processes import printed_by, process_env, start, stop

SUCCEEDING, FAILING, REJECTED = 12, 5, 3

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def fail_when_asked(envelope: dict[str, Any], request: Request) -> Response | None:
    if envelope.get("payload", {}).get("fail"):
        return JSONResponse({"error": "asked to fail"}, status_code=422)
    return None


async def metrics_url(log: Path) -> str:
    found: list[str] = []

    async def announced() -> bool:
        text = await anyio.Path(log).read_text(errors="replace")
        found[:] = re.findall(r"metrics at (http://\S+)", text)
        return bool(found)

    await eventually(announced, timeout_s=30)
    return found[0]


async def scrape(url: str) -> tuple[Samples, set[str]]:
    """Every sample on the page, by name and labels; and the families' names."""
    async with httpx.AsyncClient() as http:
        page = await http.get(url)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(page.text):
        names.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.timeout(180)
async def test_up_and_sidecar_pages_count_known_traffic(settings: Settings, tmp_path: Path) -> None:
    assert settings.redis_url is not None
    # every message through the dispatcher, whose routing histogram then counts each: down
    # a direct lane one would be counted by Redis's counters only
    env = process_env(settings, AGENT_REACH_DIRECT_LANE="false")
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("metered", behaviour=fail_when_asked) as agent,
    ):
        up = start(["up", "--metrics-port", "0"], env, tmp_path / "up.log")
        side = start(
            [
                *("sidecar", "--agent-id", "metered", "--instance-id", "metered-1"),
                *("--capability", "text.echo", "--http", agent.url, "--metrics-port", "0"),
            ],
            env,
            tmp_path / "sidecar.log",
        )
        try:
            up_url = await metrics_url(tmp_path / "up.log")
            side_url = await metrics_url(tmp_path / "sidecar.log")
            async with Client(conn) as client:
                await client.request("text.echo", {"warm": True}, timeout=30)  # routed: UP
                async with anyio.create_task_group() as tg:
                    for i in range(SUCCEEDING - 1):
                        tg.start_soon(lambda i=i: client.request("text.echo", {"n": i}))
                    for i in range(FAILING):
                        tg.start_soon(
                            lambda i=i: client.request("text.echo", {"fail": True, "n": i})
                        )
                for _ in range(REJECTED):
                    await conn.call("XADD", conn.keys.ingress, "*", "envelope", b"{not json")

            async def all_counted() -> bool:
                samples, _ = await scrape(up_url)
                finished = "agent_reach_messages_finished_total"
                return (
                    value(samples, finished, capability="", stage="REJECTED") == REJECTED
                    and value(samples, finished, capability="text.echo", stage="FAILED") == FAILING
                )

            await eventually(all_counted, timeout_s=30)
            samples, names = await scrape(up_url)
            side_samples, _ = await scrape(side_url)
        finally:
            codes = stop(side), stop(up)
    assert codes == (0, 0), "both stop cleanly, their endpoints with them"
    total = SUCCEEDING + FAILING
    assert value(samples, "agent_reach_messages_accepted_total", capability="text.echo") == total
    assert (
        value(
            samples,
            "agent_reach_messages_finished_total",
            capability="text.echo",
            stage="SUCCEEDED",
        )
        == SUCCEEDING
    )
    calls = "agent_reach_agent_calls_total"
    for outcome, n in (("succeeded", SUCCEEDING), ("failed", FAILING)):
        assert value(samples, calls, agent="metered", capability="text.echo", outcome=outcome) == n
    assert value(samples, "agent_reach_dead_letters_total", reason="rejected") == REJECTED
    assert value(samples, "agent_reach_dlq_entries") == REJECTED
    ids = {"agent": "metered", "instance": "metered-1"}
    assert value(samples, "agent_reach_instance_state", **ids, state="UP") == 1
    assert value(samples, "agent_reach_instance_state", **ids, state="DOWN") == 0
    assert value(samples, "agent_reach_credits_limit", **ids, kind="declared") == 8
    assert 0 < value(samples, "agent_reach_instance_reach_score", **ids) <= 1
    assert value(samples, "agent_reach_circuit_open", **ids) == 0
    assert value(samples, "agent_reach_needs_confirmation_messages") == 0
    assert value(samples, "agent_reach_waiting_messages", capability="text.echo") == 0
    assert value(samples, "agent_reach_routing_decision_seconds_count") >= total
    assert any(n == "agent_reach_build_info" for n in names)
    # the sidecar measured each call where the time is spent
    on_side = {"agent": "metered", "capability": "text.echo"}
    assert value(side_samples, "agent_reach_agent_call_duration_seconds_count", **on_side) == total
    for histogram in ("agent_reach_queue_wait_seconds", "agent_reach_end_to_end_seconds"):
        assert value(side_samples, f"{histogram}_count", capability="text.echo") == total
    assert not any(name[0].startswith("agent_reach_waiting") for name in side_samples)


def test_only_a_process_that_serves_metrics_measures_its_histograms() -> None:
    """A process without ``/metrics`` observes nothing (no one could read it); the endpoint,
    as it opens, turns the histograms on. In a fresh interpreter: the suite's own process may
    have opened one."""
    printed = printed_by(
        "import anyio",
        "from broker import process_metrics",
        "from workers.metrics_page import metrics_endpoint",
        "def waits():",
        "    return sum(s.value for m in process_metrics.QUEUE_WAIT.collect()",
        "               for s in m.samples if s.name.endswith('_count'))",
        "async def main():",
        "    process_metrics.queue_wait('text.echo', 0.1)",
        "    print(waits())",
        "    async with metrics_endpoint(None, '127.0.0.1', 0) as url:",
        "        process_metrics.queue_wait('text.echo', 0.1)",
        "        print(waits(), url.startswith('http://127.0.0.1:'))",
        "anyio.run(main)",
    )
    assert printed == ["0", "1.0 True"]
