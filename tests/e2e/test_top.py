"""``agent-reach top`` under a pseudo-terminal: it shows the instances, and ``q`` quits."""

from __future__ import annotations

import os
import pty
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import msgspec
import pytest
from rich.console import Console

from broker.config import Settings
from broker.connection import open_connection
from broker.embedded import RedisServer
from broker.registry import Registry
from tests.conftest import suite_redis_binary
from tests.support.agents import http_agent
from tests.support.harness import card, running_sidecar
from tests.support.processes import AGENT_REACH, process_env
from workers.cli.top import render
from workers.overview import Overview, Readings, rates


class Screen:
    """What the process wrote to its terminal so far."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    async def wait_for(self, *words: str, timeout_s: float = 30.0) -> None:
        with anyio.fail_after(timeout_s):
            while not all(w in self.text for w in words):
                await anyio.wait_readable(self.fd)
                self.text += os.read(self.fd, 65536).decode(errors="replace")


def in_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """``argv`` on a new pseudo-terminal; its master side, to read the screen and type."""
    master, slave = pty.openpty()
    process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    return process, master


@asynccontextmanager
async def top_running(settings: Settings) -> AsyncIterator[tuple[subprocess.Popen[bytes], Screen]]:
    """``agent-reach top`` refreshing every 0.2 s on a terminal of its own; killed if it is
    still running when the block ends."""
    env = {**process_env(settings), "COLUMNS": "160", "LINES": "40", "TERM": "xterm"}
    top, master = in_a_terminal([AGENT_REACH, "top", "--interval", "0.2"], env)
    try:
        yield top, Screen(master)
    finally:
        if top.poll() is None:
            top.kill()
        top.wait()
        os.close(master)


async def quit_with_q(top: subprocess.Popen[bytes], screen: Screen) -> int:
    """Type ``q``; the exit code, once it has exited."""
    os.write(screen.fd, b"q")
    with anyio.fail_after(15):
        while top.poll() is None:  # noqa: ASYNC110 - a process exit, polled with a deadline
            await anyio.sleep(0.05)
    return top.returncode


@pytest.mark.timeout(90)
async def test_top_shows_the_instances_live_and_q_quits(settings: Settings) -> None:
    assert settings.redis_url is not None
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("topped") as agent,
        running_sidecar(conn, "topped-1", ("text.echo",), url=agent.url),
        top_running(settings) as (top, screen),
    ):
        await screen.wait_for("agent-reach top", "topped-1", "UP", "text.echo")
        async with running_sidecar(conn, "topped-2", ("text.echo",), url=agent.url):
            await screen.wait_for("topped-2")  # live: a new instance shows up by itself
        assert await quit_with_q(top, screen) == 0


@pytest.mark.timeout(90)
async def test_top_says_redis_is_away_and_goes_on_live_when_it_is_back(
    settings: Settings, tmp_path: Path
) -> None:
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    try:
        async with top_running(own) as (top, screen):
            await screen.wait_for("agent-reach top")
            server.stop()
            await screen.wait_for("Redis is unavailable (", "from before")
            server = RedisServer.start(tmp_path / "redis", binary=binary, port=server.port)
            async with open_connection(own, server.url) as conn:
                await Registry(conn).register(card("returned-1", ("text.echo",)), credits=1)
            await screen.wait_for("returned-1")  # read after the restart: live again
            assert await quit_with_q(top, screen) == 0
    finally:
        server.stop()


def test_rates_are_per_second_between_two_readings() -> None:
    def reading(at_ms: int, accepted: int, succeeded: int) -> Overview:
        totals = {"accepted": accepted, "SUCCEEDED": succeeded}
        return Overview(at_ms, totals, [], [], 0, 0)

    first, second = reading(1_000, 10, 4), reading(3_000, 30, 10)
    assert rates(None, first) == {}
    assert rates(first, second) == {"accepted": 10.0, "SUCCEEDED": 3.0, "FAILED": 0.0}
    assert rates(second, first) == {}  # a reading from before: no rate
    assert rates(second, reading(4_000, 5, 12)) == {}  # a total fell: the counts restarted


def test_no_rate_is_shown_across_an_outage() -> None:
    """Rates between two readings with Redis away between them would average the outage in:
    the first reading after it shows none ("-/s"), the next one rates again."""
    readings = Readings()

    def reading(at_ms: int, accepted: int) -> Overview:
        return Overview(at_ms, {"accepted": accepted}, [], [], 0, 0)

    first = readings.read(reading(1_000, 10))
    assert first.rates == {} and "accepted 10 (-/s)" in screen_text(first)
    assert readings.read(reading(2_000, 30)).rates["accepted"] == 20.0
    readings.lost()
    back = readings.read(reading(62_000, 90))  # a minute away
    assert back.rates == {} and "accepted 90 (-/s)" in screen_text(back)
    assert readings.last is back
    again = readings.read(reading(63_000, 100))
    assert again.rates["accepted"] == 10.0 and "accepted 100 (10.0/s)" in screen_text(again)


def screen_text(view: Overview) -> str:
    console = Console(width=200, record=True)
    console.print(render(view))
    return console.export_text()
