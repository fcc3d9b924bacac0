"""``agent-reach sidecar --adapter http-async``: a real sidecar process, a real async agent."""

from __future__ import annotations

from pathlib import Path

import msgspec
from click.testing import CliRunner

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.async_agents import async_agent
from tests.support.harness import collect_replies, running_dispatcher
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
