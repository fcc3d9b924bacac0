"""Hosts whose clocks are off: each process aligns its clock to Redis's (broker/timekeeping.py).

The skewed process is a real ``agent-reach`` process whose wall clock is really off: libfaketime
is preloaded into it (``FAKETIME`` says by how much: ``-30s``, ``+60s``, ``-10m``), its
monotonic clock left alone; this test process, Redis and the other processes keep the host's
clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import libfaketime
import pytest

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.health import observed_state
from broker.records import InstanceState
from broker.registry import Registry
from broker.stages import Stage
from broker.timekeeping import now_ms
from tests.support.agents import http_agent
from tests.support.harness import eventually
from tests.support.processes import process_env, start, stop


def clock_off_by(env: dict[str, str], offset: str) -> dict[str, str]:
    """``env`` for a process whose wall clock reads ``offset`` (libfaketime's form: ``-30s``,
    ``-10m``) from the host's."""
    _, preload = libfaketime.get_reload_information()
    paths = {  # the library's, before any the environment names already
        name: ":".join(filter(None, (value, env.get(name))))
        for name, value in preload.items()
        if name in ("LD_PRELOAD", "LD_LIBRARY_PATH")
    }
    return {**env, **preload, **paths, "FAKETIME": offset}


def echo_sidecar(
    name: str, agent_url: str, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """A sidecar process, instance ``<name>-1``, serving ``text.echo`` from ``agent_url``."""
    return start(
        [
            *("sidecar", "--agent-id", name, "--instance-id", f"{name}-1"),
            *("--capability", "text.echo", "--http", agent_url),
        ],
        env,
        log,
    )


async def state_of(conn: Connection, settings: Settings, instance_id: str) -> InstanceState | None:
    """The state a router reads for ``instance_id`` now (``None``: no card)."""
    views = [v for v in await Registry(conn).snapshot() if v.instance_id == instance_id]
    if not views:
        return None
    down_after_ms = int(settings.down_after_s * 1000)
    return observed_state(views[0], now_ms=now_ms(), down_after_ms=down_after_ms)


@contextmanager
def processes(*running: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for process in running:
            stop(process)


def test_the_preloaded_clock_is_off() -> None:
    """The tool works: a process started this way reads a clock 30 s behind."""
    done = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env=clock_off_by(dict(os.environ), "-30s"),
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert 29.0 < now_ms() / 1000 - float(done.stdout) < 35.0


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_sidecar_whose_clock_runs_behind_is_up_and_gets_work(
    settings: Settings, tmp_path: Path
) -> None:
    """Its clock 30 s behind, six times ``down_after_s``: on its own clock its heartbeats
    would read as 30 s old, DOWN, and it would get no work."""
    assert settings.redis_url is not None
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("skewed") as agent,
    ):
        env = process_env(settings)
        up = start(["up"], env, tmp_path / "up.log")
        side = echo_sidecar(
            "skewed", agent.url, clock_off_by(env, "-30s"), tmp_path / "sidecar.log"
        )
        with processes(side, up):
            registry = Registry(conn)

            async def registered() -> bool:
                return any(v.instance_id == "skewed-1" for v in await registry.snapshot())

            await eventually(registered, timeout_s=30)
            async with Client(conn) as client:
                result = await client.request("text.echo", {"x": 1}, timeout=30)
            assert result.stage is Stage.SUCCEEDED

            (view,) = [v for v in await registry.snapshot() if v.instance_id == "skewed-1"]
            assert await state_of(conn, settings, "skewed-1") is InstanceState.UP
            assert abs(now_ms() - view.heartbeat_ms) < 5_000
            trace = await Client(conn).trace(result.id)
            assert trace.timeline[-1].stage is Stage.SUCCEEDED
            # the sidecar's stages on the dispatcher's clock, not 30 s before its acceptance
            accepted_ms = trace.record.accepted_ms
            assert all(abs(e.ts_ms - accepted_ms) < 5_000 for e in trace.timeline)
    assert "behind Redis's" in (tmp_path / "sidecar.log").read_text()


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_dispatcher_whose_clock_runs_behind_sets_deadlines_on_redis_clock(
    settings: Settings, tmp_path: Path
) -> None:
    """Its clock 10 minutes behind, past the message's 60 s: on its own clock it would set a
    deadline that has already passed, and the sidecar would end the message EXPIRED."""
    assert settings.redis_url is not None
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("plain") as agent,
    ):
        env = process_env(settings, AGENT_REACH_DIRECT_LANE="false")
        up = start(["up"], clock_off_by(env, "-10m"), tmp_path / "up.log")
        side = echo_sidecar("plain", agent.url, env, tmp_path / "sidecar.log")
        with processes(side, up):
            async with Client(conn) as client:
                sent_ms = now_ms()
                result = await client.request("text.echo", {"x": 1}, timeout=60)
            assert result.stage is Stage.SUCCEEDED, result
            record = (await Client(conn).trace(result.id)).record
            assert abs(record.deadline_ms - (sent_ms + 60_000)) < 10_000
    assert "behind Redis's" in (tmp_path / "up.log").read_text()


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_sidecar_whose_clock_runs_ahead_reads_down_once_it_dies(
    settings: Settings, tmp_path: Path
) -> None:
    """Its clock 60 s ahead: on its own clock its last heartbeat would read as alive for a
    minute after a SIGKILL; on Redis's, it reads DOWN ``down_after_s`` after it."""
    assert settings.redis_url is not None
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("ahead") as agent,
    ):
        side = echo_sidecar(
            "ahead",
            agent.url,
            clock_off_by(process_env(settings), "+60s"),
            tmp_path / "sidecar.log",
        )
        with processes(side):

            async def up() -> bool:
                return await state_of(conn, settings, "ahead-1") is InstanceState.UP

            await eventually(up, timeout_s=30)
            side.kill()
            side.wait()

            async def down() -> bool:
                return await state_of(conn, settings, "ahead-1") is InstanceState.DOWN

            await eventually(down, timeout_s=settings.down_after_s + 10)
    assert "ahead of Redis's" in (tmp_path / "sidecar.log").read_text()
