"""``agent-reach sidecar --adapter http-async``: a real sidecar process, a real async agent."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from click.testing import CliRunner

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.async_agents import AsyncAgent, async_agent
from tests.support.harness import collect_replies, eventually, running_dispatcher
from tests.support.processes import process_env, start, stop
from tests.support.usage_days import spending_lately, usage_lately
from workers.cli import main


def test_http_async_needs_an_http_url() -> None:
    argv = ["sidecar", "--agent-id", "a", "--capability", "a.b", "--adapter", "http-async"]
    result = CliRunner().invoke(main, [*argv, "--python", "m:x"])

    assert result.exit_code == 2 and "--adapter http-async needs --http URL" in result.output


async def test_an_async_agent_behind_a_sidecar_process(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    async with async_agent(call_back_after_s=0.5) as agent, running_dispatcher(conn):
        args = [
            "sidecar",
            "--agent-id",
            "thinker",
            "--instance-id",
            "thinker-1",
            "--capability",
            "text.think",
            "--adapter",
            "http-async",
            "--http",
            agent.url,
            "--status-url",
            agent.status_url,
            "--callback-host",
            "127.0.0.1",
        ]
        process = start(args, process_env(settings), tmp_path / "sidecar.log")
        try:
            client = Client(conn)
            reply_to = client.new_reply_stream()
            raw = {"capability": "text.think", "reply_to": reply_to, "payload": [1, 2]}
            message_id = await client.submit(
                msgspec.json.decode(msgspec.json.encode(raw), type=Envelope)
            )
            replies = await collect_replies(conn, reply_to, 1, timeout_s=60)
        finally:
            assert stop(process) == 0  # SIGTERM: a graceful stop

    assert replies[message_id].stage is Stage.SUCCEEDED
    assert replies[message_id].result == {"echo": [1, 2]}
    assert agent.received[message_id].callback_url.startswith("http://127.0.0.1:")
    stages = [e.stage for e in await MessageStore(conn).get_timeline(message_id)]
    assert stages[-2:] == [Stage.CALLBACK_RECEIVED, Stage.SUCCEEDED]
    log = (tmp_path / "sidecar.log").read_text()
    assert "callbacks at http://127.0.0.1:" in log
    assert "only under the same --instance-id and --callback-port" in log  # port 0: warned


THINKER = [
    *("sidecar", "--agent-id", "thinker", "--instance-id", "thinker-1"),
    *("--capability", "text.think", "--adapter", "http-async"),
    *("--callback-host", "127.0.0.1"),
]


def read_log(log: Path) -> str:
    return log.read_text()


async def crashed_after_callback(
    conn: Connection, settings: Settings, log: Path, agent: AsyncAgent, body: dict[str, Any]
) -> tuple[str, str]:
    """A message whose callback (``body``) a real sidecar process recorded (CALLBACK_RECEIVED)
    before it SIGKILLed itself at the failpoint right after: (its reply stream, its id)."""
    env = process_env(settings, AGENT_REACH_FAILPOINTS="sidecar.after_callback_recorded=kill")
    process = start([*THINKER, "--http", agent.url], env, log)
    try:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        raw = {"capability": "text.think", "reply_to": reply_to, "tenant": "team-a"}
        message_id = await client.submit(
            msgspec.json.decode(msgspec.json.encode(raw), type=Envelope)
        )

        async def taken() -> bool:
            return message_id in agent.received

        await eventually(taken, timeout_s=20)
        with pytest.raises(httpx.HTTPError):  # the sidecar dies before it answers
            await agent.call_back(message_id, body)

        async def killed() -> bool:
            return process.poll() is not None

        await eventually(killed)
    finally:
        stop(process)
    assert process.returncode == -signal.SIGKILL, read_log(log)
    record = await MessageStore(conn).get_record(message_id)
    assert record is not None and record.stage is Stage.CALLBACK_RECEIVED
    return reply_to, message_id


async def charged_usage(conn: Connection, message_id: str) -> tuple[Any, str, dict[str, float]]:
    """What the record keeps of the usage (``usage:1``), the last timeline entry's reason, and
    the day's figures of agent ``thinker``."""
    stored = await conn.call("HGET", conn.keys.record(message_id), "usage:1")
    timeline = await MessageStore(conn).get_timeline(message_id)
    (totals,) = [t for t in await usage_lately(conn, "agent") if t.name == "thinker"]
    return json.loads(stored or b"null"), timeline[-1].reason, totals.figures


async def test_a_callback_recorded_before_a_crash_is_finished_with_its_usage(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    """Restarted, the sidecar finishes the message from the record — and charges the usage
    the agent reported beside its error, which the record keeps (``usage:<attempt>``)."""
    spent = {"input_tokens": 10, "output_tokens": 2, "cost": 0.125}
    log = tmp_path / "sidecar.log"
    async with async_agent() as agent, running_dispatcher(conn):
        body = {"error": "could not think", "usage": spent}
        reply_to, message_id = await crashed_after_callback(conn, settings, log, agent, body)
        process = start([*THINKER, "--http", agent.url], process_env(settings), log)
        try:
            replies = await collect_replies(conn, reply_to, 1, timeout_s=60)
        finally:
            assert stop(process) == 0

    assert replies[message_id].stage is Stage.FAILED
    stored, reason, figures = await charged_usage(conn, message_id)
    assert stored == spent and "usage in=10 out=2 cost=0.125" in reason
    assert figures["requests"] == 1 and figures["failed"] == 1 and figures["cost"] == 0.125


async def test_a_callback_whose_sidecar_never_returns_is_finished_and_charged_by_the_reaper(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    """The sidecar stays dead: once it is DOWN the reaper finishes the message with the
    recorded result, and charges the agent the attempt and the usage it reported."""
    used = {"input_tokens": 1500, "output_tokens": 250, "cost": 0.375}
    log = tmp_path / "sidecar.log"
    async with async_agent() as agent, running_dispatcher(conn):
        body = {"result": {"summary": "ok"}, "usage": used}
        reply_to, message_id = await crashed_after_callback(conn, settings, log, agent, body)
        replies = await collect_replies(conn, reply_to, 1, timeout_s=60)

    assert replies[message_id].stage is Stage.SUCCEEDED
    assert replies[message_id].result == {"summary": "ok"}
    stored, reason, figures = await charged_usage(conn, message_id)
    assert stored == used and "finished by the reaper" in reason
    assert "usage in=1500 out=250 cost=0.375" in reason
    assert figures["requests"] == 1 and figures["succeeded"] == 1 and figures["cost"] == 0.375
    assert (await spending_lately(conn))[1] == {"team-a": 0.375}
