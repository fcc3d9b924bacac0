"""``agent-reach top`` under a pseudo-terminal: it shows the instances, and ``q`` quits."""

from __future__ import annotations

import os
import pty
import subprocess

import anyio
import pytest

from broker.config import Settings
from broker.connection import open_connection
from tests.support.agents import http_agent
from tests.support.harness import running_sidecar
from tests.support.processes import AGENT_REACH, process_env
from workers.overview import Overview, rates


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


@pytest.mark.timeout(90)
async def test_top_shows_the_instances_live_and_q_quits(settings: Settings) -> None:
    assert settings.redis_url is not None
    async with (
        open_connection(settings, settings.redis_url) as conn,
        http_agent("topped") as agent,
        running_sidecar(conn, "topped-1", ("text.echo",), url=agent.url),
    ):
        env = {**process_env(settings), "COLUMNS": "160", "LINES": "40", "TERM": "xterm"}
        top, master = in_a_terminal([AGENT_REACH, "top", "--interval", "0.2"], env)
        try:
            screen = Screen(master)
            await screen.wait_for("agent-reach top", "topped-1", "UP", "text.echo")
            async with running_sidecar(conn, "topped-2", ("text.echo",), url=agent.url):
                await screen.wait_for("topped-2")  # live: a new instance shows up by itself
            os.write(master, b"q")
            with anyio.fail_after(15):
                while top.poll() is None:  # noqa: ASYNC110 - a process exit, polled with a deadline
                    await anyio.sleep(0.05)
            assert top.returncode == 0
        finally:
            if top.poll() is None:
                top.kill()
            top.wait()
            os.close(master)


def test_rates_are_per_second_between_two_readings() -> None:
    def reading(at_ms: int, accepted: int, succeeded: int) -> Overview:
        totals = {"accepted": accepted, "SUCCEEDED": succeeded}
        return Overview(at_ms, totals, [], [], 0, 0)

    first, second = reading(1_000, 10, 4), reading(3_000, 30, 10)
    assert rates(None, first) == {}
    assert rates(first, second) == {"accepted": 10.0, "SUCCEEDED": 3.0, "FAILED": 0.0}
    assert rates(second, first) == {}  # a reading from before: no rate
