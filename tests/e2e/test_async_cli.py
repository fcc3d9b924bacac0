"""``agent-reach sidecar --adapter http-async``: a real sidecar process, a real async agent."""

from __future__ import annotations

import json
import signal
from pathlib import Path

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
from tests.support.async_agents import async_agent
from tests.support.harness import collect_replies, eventually, running_dispatcher
from tests.support.processes import process_env, start, stop
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


async def test_a_callback_recorded_before_a_crash_is_finished_with_its_usage(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    """The sidecar process SIGKILLs itself right after writing CALLBACK_RECEIVED; restarted,
    it finishes the message from the record — and charges the usage the agent reported beside
    its error, which the record keeps (``usage:<attempt>``), not only the result."""
    spent = {"input_tokens": 10, "output_tokens": 2, "cost": 0.125}
    async with async_agent() as agent, running_dispatcher(conn):
        args = [
            *("sidecar", "--agent-id", "thinker", "--instance-id", "thinker-1"),
            *("--capability", "text.think", "--adapter", "http-async", "--http", agent.url),
            *("--callback-host", "127.0.0.1"),
        ]
        crashing = process_env(
            settings, AGENT_REACH_FAILPOINTS="sidecar.after_callback_recorded=kill"
        )
        process = start(args, crashing, tmp_path / "sidecar.log")
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
                await agent.call_back(message_id, {"error": "could not think", "usage": spent})

            async def killed() -> bool:
                return process.poll() is not None

            await eventually(killed)
        finally:
            stop(process)
        assert process.returncode == -signal.SIGKILL, (tmp_path / "sidecar.log").read_text()
        store = MessageStore(conn)
        assert (await store.get_record(message_id)).stage is Stage.CALLBACK_RECEIVED  # type: ignore[union-attr]

        process = start(args, process_env(settings), tmp_path / "sidecar.log")
        try:
            replies = await collect_replies(conn, reply_to, 1, timeout_s=60)
        finally:
            assert stop(process) == 0

    assert replies[message_id].stage is Stage.FAILED
    stored = await conn.call("HGET", conn.keys.record(message_id), "usage:1")
    assert stored is not None and json.loads(stored) == spent
    timeline = await store.get_timeline(message_id)
    assert [e.stage for e in timeline][-2:] == [Stage.CALLBACK_RECEIVED, Stage.FAILED]
    assert "usage in=10 out=2 cost=0.125" in timeline[-1].reason
