"""An ``--adapter mcp`` sidecar process SIGKILLed while its tool runs, then restarted: an
idempotent tool (``idempotentHint``) is called again with the same idempotency key and the
message succeeds; a non-idempotent one is parked for an operator, never run again on a
guess. The server is built with the official ``mcp`` SDK (tests/support/mcp_servers.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.harness import eventually, running_dispatcher
from tests.support.mcp_servers import RunningServer, mcp_http_server
from tests.support.processes import process_env, start, stop


def sidecar_args(url: str, tool: str, capability: str) -> list[str]:
    return [
        *("sidecar", "--agent-id", "kv", "--instance-id", "kv-1", "--adapter", "mcp"),
        *("--url", url, "--tool", f"{tool}={capability}", "--grace", "2"),
    ]


async def killed_mid_call_then_restarted(
    conn: Connection, settings: Settings, tmp_path: Path, tool: str, settles_as: Stage
) -> tuple[RunningServer, str, list[str]]:
    store = MessageStore(conn)
    async with mcp_http_server() as server, running_dispatcher(conn):
        args = sidecar_args(server.url, tool, "kv.op")
        doomed = start(args, process_env(settings), tmp_path / "sidecar1.log")
        payload = msgspec.json.encode({"key": "k1", "seconds": 3})
        message_id = await Client(conn).submit(
            Envelope(capability="kv.op", payload=msgspec.Raw(payload), timeout_s=120)
        )

        async def calling() -> bool:
            return server.log.running == 1

        await eventually(calling, timeout_s=30)
        doomed.kill()
        doomed.wait()
        restarted = start(args, process_env(settings), tmp_path / "sidecar2.log")
        try:

            async def settled() -> bool:
                record = await store.get_record(message_id)
                return record is not None and record.stage is settles_as

            await eventually(settled, timeout_s=60)
        finally:
            assert stop(restarted) == 0
    timeline = [str(e.stage) for e in await store.get_timeline(message_id)]
    return server, message_id, timeline


@pytest.mark.timeout(120)
async def test_an_idempotent_tool_is_called_again_after_its_sidecar_is_killed(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    server, _, timeline = await killed_mid_call_then_restarted(
        conn, settings, tmp_path, "slow_read", Stage.SUCCEEDED
    )
    assert server.log.starts["k1"] == 2  # the killed call, and the one after the restart
    assert timeline[-2:] == ["PROCESSING", "SUCCEEDED"], timeline


@pytest.mark.timeout(120)
async def test_a_non_idempotent_tool_is_parked_after_its_sidecar_is_killed(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    server, _, timeline = await killed_mid_call_then_restarted(
        conn, settings, tmp_path, "slow_write", Stage.NEEDS_CONFIRMATION
    )
    assert server.log.starts["k1"] == 1  # never run again on a guess
    assert timeline[-1] == "NEEDS_CONFIRMATION", timeline
