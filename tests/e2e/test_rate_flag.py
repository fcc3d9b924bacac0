"""``agent-reach sidecar --rate 10/s --burst 3``, the real process: the limit it asks for is
the limit its agent sees (at most burst + 10 calls in any second), and no message fails."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker.client import Client
from broker.config import Settings
from broker.connection import open_connection
from tests.integration.test_rate_limits import Arrivals, _send_all
from tests.support.agents import http_agent
from tests.support.harness import eventually, running_dispatcher
from tests.support.processes import process_env, start, stop

N = 40


@pytest.mark.timeout(120)
async def test_the_rate_flag_limits_what_the_agent_receives(
    settings: Settings, tmp_path: Path
) -> None:
    assert settings.redis_url is not None
    argv = ["sidecar", "--agent-id", "paced", "--instance-id", "paced-1"]
    argv += ["--capability", "text.echo", "--rate", "10/s", "--burst", "3"]
    arrivals = Arrivals()
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("paced", behaviour=arrivals) as agent,
    ):
        process = start([*argv, "--http", agent.url], process_env(settings), tmp_path / "s.log")
        try:

            async def registered() -> bool:
                return bool(await conn.call("EXISTS", conn.keys.card("paced-1")))

            await eventually(registered)
            rate_ms, burst = await conn.call("HMGET", conn.keys.card("paced-1"), "rate_ms", "burst")
            async with running_dispatcher(conn), Client(conn) as client:
                started = time.monotonic()
                results = await _send_all(client, N)
                took = time.monotonic() - started
        finally:
            stop(process)
    assert (float(rate_ms), int(burst)) == (100.0, 3)  # 10/s: one call every 100 ms
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert len(arrivals.times) == N
    assert arrivals.most_in_any_second() <= 3 + 10
    assert took >= (N - 3) / 10 - 0.5  # the limit set the pace
    print(f"{N} in {took:.1f} s, most in any second {arrivals.most_in_any_second()}")
