"""Health seen from outside: a real sidecar process stopped (SIGSTOP) and resumed."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import msgspec
import pytest

from broker.config import Settings
from broker.connection import open_connection
from broker.health import observed_state
from broker.records import InstanceState
from broker.registry import Registry
from broker.timekeeping import now_ms
from tests.support.agents import http_agent
from tests.support.harness import eventually
from tests.support.processes import process_env, start, stop

HEARTBEAT_S = 0.3
DOWN_AFTER_S = 3 * HEARTBEAT_S


@pytest.mark.timeout(120)
async def test_silent_instance_is_down_within_three_intervals_and_up_after_three_beats(
    settings: Settings, tmp_path: Path
) -> None:
    quick = msgspec.structs.replace(settings, heartbeat_s=HEARTBEAT_S, down_after_s=DOWN_AFTER_S)
    assert quick.redis_url is not None
    argv = [
        "sidecar",
        "--agent-id",
        "beat",
        "--instance-id",
        "beat-1",
        "--capability",
        "text.echo",
        "--max-inflight",
        "2",
        "--grace",
        "2",
    ]
    async with open_connection(quick, quick.redis_url) as conn, http_agent("beat") as agent:
        registry = Registry(conn)
        process = start([*argv, "--http", agent.url], process_env(quick), tmp_path / "s.log")
        try:

            async def state() -> InstanceState | None:
                views = [v for v in await registry.snapshot() if v.instance_id == "beat-1"]
                if not views:
                    return None
                return observed_state(
                    views[0], now_ms=now_ms(), down_after_ms=int(DOWN_AFTER_S * 1000)
                )

            async def is_up() -> bool:
                return await state() is InstanceState.UP

            await eventually(is_up)
            process.send_signal(signal.SIGSTOP)
            stopped_at = anyio.current_time()

            async def is_down() -> bool:
                return await state() is InstanceState.DOWN

            await eventually(is_down, timeout_s=10)
            # silent for three intervals (plus at most one interval of phase)
            assert anyio.current_time() - stopped_at <= DOWN_AFTER_S + HEARTBEAT_S + 0.5

            last_before = int(await conn.call("HGET", conn.keys.card("beat-1"), "hb_ms"))
            beats: list[tuple[int, bytes]] = []
            process.send_signal(signal.SIGCONT)

            async def back_up() -> bool:
                hb, card_state = await conn.call(
                    "HMGET", conn.keys.card("beat-1"), "hb_ms", "state"
                )
                if int(hb) > last_before and (not beats or beats[-1][0] != int(hb)):
                    beats.append((int(hb), card_state))
                return bool(beats) and beats[-1][1] == b"UP"  # a beat since SIGCONT says UP

            await eventually(back_up, timeout_s=10, interval_s=0.01)
            # the first beat knows it was silent too long (DOWN); UP after three healthy ones
            assert [s for _, s in beats] == [b"DOWN", b"DOWN", b"DOWN", b"UP"], beats
        finally:
            process.send_signal(signal.SIGCONT)
            stop(process)
