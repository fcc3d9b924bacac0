"""Chaos: real processes SIGKILLed and restarted at random (and Redis once, mid-run) while a
producer submits messages. Nothing may be lost, and the agent that is not idempotent may
never run a message twice.

Part of the normal suite; select with ``-m chaos`` or leave out with ``-m "not chaos"``.
``AGENT_REACH_CHAOS=5000`` runs 5,000 messages instead of 1,000 (``CHAOS_SEED=N`` replays a
schedule's seed; the timing of a run is never exactly reproducible).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .report import render
from .run import Observed, Plan, new_seed, run_chaos

CI_MESSAGES = 1000
BIG_MESSAGES = 5000


def chaos_messages() -> int:
    """``AGENT_REACH_CHAOS``: a message count, or a true flag for the big run."""
    value = os.environ.get("AGENT_REACH_CHAOS", "").strip().lower()
    if not value or value in ("0", "false", "no"):
        return CI_MESSAGES
    if value in ("1", "true", "yes"):
        return BIG_MESSAGES
    return int(value)


MESSAGES = chaos_messages()


def plan(
    messages: int,
    appendfsync: str,
    *,
    rate: float = 25.0,
    least_s: float = 20.0,
    cluster_binary: Path | None = None,
) -> Plan:
    seed = int(os.environ.get("CHAOS_SEED") or new_seed())
    # captured, and shown with a failure of any kind (a timeout, an error before the report)
    print(f"chaos seed {seed}: CHAOS_SEED={seed} replays this schedule")
    produce_s = max(least_s, min(150.0, messages / rate))
    return Plan(messages, appendfsync, seed, produce_s, cluster_binary=cluster_binary)


def publish(seen: Observed, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The report on the terminal (even when the test passes) and in the test's tmp dir."""
    text = render(seen)
    path = tmp_path / "chaos-report.txt"
    path.write_text(text)
    with capsys.disabled():
        print(f"\n{text}(written to {path})")
    return text


@pytest.mark.chaos
@pytest.mark.timeout(240 + MESSAGES // 10)
async def test_nothing_lost_and_nothing_run_twice_under_crashes_with_appendfsync_always(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = await run_chaos(
        tmp_path, plan(MESSAGES, "always", rate=25.0 if MESSAGES <= 1000 else 50.0)
    )
    text = publish(seen, tmp_path, capsys)
    assert len(seen.redis_restarts) == 1, text
    assert seen.lost() == [], text
    assert seen.executed_twice() == {}, text


@pytest.mark.chaos
@pytest.mark.timeout(240)
async def test_chaos_report_with_appendfsync_everysec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis SIGKILL may drop up to a second of acknowledged writes under ``everysec``: the
    report says what was lost and why, and nothing is asserted about it. Ten seconds (Redis
    killed halfway, a process or two besides) make the report; the proofs run longer."""
    seen = await run_chaos(tmp_path, plan(250, "everysec", least_s=10.0))
    text = publish(seen, tmp_path, capsys)
    assert len(seen.redis_restarts) == 1, text


@pytest.mark.chaos
@pytest.mark.timeout(240 + MESSAGES // 10)
async def test_nothing_lost_and_nothing_run_twice_under_crashes_on_a_redis_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis7_binary: Path
) -> None:
    """Three masters (Redis 7: credits announced on sharded channels), three ingress, due set
    and outbox partitions; dispatchers, reapers and sidecars SIGKILLed at random."""
    seen = await run_chaos(
        tmp_path, plan(MESSAGES, "always", rate=40.0, cluster_binary=redis7_binary)
    )
    text = publish(seen, tmp_path, capsys)
    assert seen.redis_restarts == [] and sum(seen.kills.values()) >= 8, text
    assert seen.lost() == [], text
    assert seen.executed_twice() == {}, text
