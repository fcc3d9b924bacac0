"""A newcomer's first commands, as real processes on a machine with nothing set up: a fresh
home, no ``AGENT_REACH_*`` variables, the embedded Redis. Nothing they run may break the
next command or leave the Redis changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.embedded import embedded_redis, running_embedded_url
from tests.support.agents import http_agent
from tests.support.harness import eventually, running_sidecar
from tests.support.processes import AGENT_REACH


def fresh_home(home: Path) -> dict[str, str]:
    """The environment of a user who has never run agent-reach: the embedded Redis's data
    goes where it goes by default, ``~/.local/state/agent-reach/redis``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENT_REACH_") and k != "XDG_STATE_HOME"
    }
    env["HOME"] = str(home)
    return env


def data_dir_of(home: Path) -> Path:
    return home / ".local" / "state" / "agent-reach" / "redis"


async def agent_reach(env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    done = await anyio.run_process([AGENT_REACH, *argv], env=env, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def until_said(process: Process, words: str, *, timeout_s: float) -> str:
    """Read the process's stderr until it has said ``words``; what it said so far."""
    assert process.stderr is not None
    said = ""
    with anyio.fail_after(timeout_s):
        while words not in said:
            said += (await process.stderr.receive()).decode(errors="replace")
    return said


async def keys_matching(conn: Connection, pattern: str) -> list[bytes]:
    cursor, found = b"0", []
    while True:
        cursor, keys = await conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        found += keys
        if cursor == b"0":
            return list(found)


def settings_for(url: str) -> Settings:
    return build_settings([{"redis_url": url}])  # the defaults, as a newcomer's processes


@pytest.mark.timeout(300)
async def test_demo_twice_then_up_and_a_request_all_succeed(tmp_path: Path) -> None:
    env = fresh_home(tmp_path)
    data_dir = data_dir_of(tmp_path)

    for run in range(2):
        code, out, err = await agent_reach(env, "demo", "--messages", "300")
        assert code == 0, out + err
        lost_line = next(line for line in out.splitlines() if "lost" in line)
        assert lost_line.replace("│", " ").split() == ["lost", "0"]
        if run == 0:  # the first command of all says what it started, and where its data is
            assert "agent-reach: starting an embedded Redis" in err, err
            assert f"data in {data_dir}" in err, err

    up = await anyio.open_process(
        [AGENT_REACH, "up"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        said = await until_said(up, "agent-reach: dispatching from", timeout_s=60)
        assert f"data in {data_dir}" in said, said
        url = running_embedded_url(data_dir)
        assert url is not None
        settings = settings_for(url)
        async with (
            open_connection(settings, url) as conn,
            http_agent("echo") as agent,
            running_sidecar(conn, "echo-1", ("text.echo",), url=agent.url),
        ):
            assert await keys_matching(conn, "demo-*") == []  # the demos took theirs away
            code, out, err = await agent_reach(
                env, "send", "text.echo", "--payload", '{"hello": 1}', "--wait"
            )
            assert code == 0, out + err
            assert "using the embedded Redis on 127.0.0.1" in err, err
            result = json.loads(out)
            assert result["stage"] == "SUCCEEDED" and result["result"]["echo"] == {"hello": 1}
    finally:
        up.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            code = await up.wait()
        await up.aclose()
    assert code == 0


async def memory_used(conn: Connection) -> int:
    info = (await conn.call("INFO", "memory")).decode()
    return int(next(line for line in info.splitlines() if line.startswith("used_memory:"))[12:])


async def seed_user_keys(conn: Connection) -> dict[bytes, bytes]:
    """Keys a user had before any demo: they must come through as they were."""
    mine = {b"reach:mine": b"keep me", b"demo-precious": b"not the demo's"}
    for key, value in mine.items():
        await conn.call("SET", key, value)
    await conn.call("XADD", "reach:in", "*", "envelope", "{}")
    return mine


@pytest.mark.timeout(300)
async def test_ten_demos_leave_the_redis_as_it_was(tmp_path: Path) -> None:
    """The user's embedded Redis is running (as under ``up``); ten demos reuse it."""
    env = fresh_home(tmp_path)
    with embedded_redis(data_dir_of(tmp_path)) as url:
        settings = settings_for(url)
        async with open_connection(settings, url) as conn:
            mine = await seed_user_keys(conn)
            keys_before = int(await conn.call("DBSIZE"))
            code, out, err = await agent_reach(env, "demo", "--messages", "50")
            assert code == 0, out + err
            assert "using the embedded Redis" in err, err
            # measured after one demo: the scripts it loaded stay cached, like any client's
            memory_before = await memory_used(conn)
            for _ in range(9):
                code, out, err = await agent_reach(env, "demo", "--messages", "50")
                assert code == 0, out + err

            assert int(await conn.call("DBSIZE")) == keys_before
            for key, value in mine.items():
                assert await conn.call("GET", key) == value
            assert int(await conn.call("XLEN", "reach:in")) == 1
            assert abs(await memory_used(conn) - memory_before) < 256 * 1024


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=str)
async def test_a_demo_stopped_removes_its_keys(tmp_path: Path, stop: signal.Signals) -> None:
    """Ctrl-C, `timeout` or `docker stop` (SIGTERM), a closed terminal (SIGHUP)."""
    env = fresh_home(tmp_path)
    with embedded_redis(data_dir_of(tmp_path)) as url:
        settings = settings_for(url)
        async with open_connection(settings, url) as conn:
            keys_before = int(await conn.call("DBSIZE"))
            demo = await anyio.open_process(
                [AGENT_REACH, "demo", "--messages", "20000"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:

                async def records_written() -> bool:
                    return len(await keys_matching(conn, "demo-*:m:*")) > 100

                await eventually(records_written, timeout_s=120)
                demo.send_signal(stop)
                with anyio.fail_after(120):
                    await demo.wait()
            finally:
                if demo.returncode is None:
                    demo.kill()
                await demo.aclose()

            assert await keys_matching(conn, "demo-*") == []
            assert int(await conn.call("DBSIZE")) == keys_before
