"""A real sidecar process killed with SIGKILL at exact protocol steps, then restarted."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import RunningAgent, http_agent
from tests.support.harness import collect_replies, eventually, running_dispatcher
from tests.support.processes import process_env, start, stop


def sidecar_args(agent: RunningAgent, *extra: str) -> list[str]:
    return [
        "sidecar",
        "--agent-id",
        "crash",
        "--instance-id",
        "crash-1",
        "--capability",
        "text.echo",
        "--http",
        agent.url,
        "--max-inflight",
        "4",
        "--grace",
        "5",
        *extra,
    ]


async def exited(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    async def done() -> bool:
        return process.poll() is not None

    await eventually(done, timeout_s=timeout_s)
    assert process.returncode is not None
    return process.returncode


async def registered(conn: Connection, instance_id: str) -> None:
    async def present() -> bool:
        return await conn.call("HGET", conn.keys.card(instance_id), "state") == b"UP"

    await eventually(present, timeout_s=30)


async def crash_then_restart(
    conn: Connection,
    settings: Settings,
    tmp_path: Path,
    failpoint: str,
    *extra: str,
    settles_as: Stage = Stage.SUCCEEDED,
) -> tuple[RunningAgent, str, list[Stage], Stage]:
    """Kill the sidecar at ``failpoint`` on the first message, restart it, and wait until the
    message's record reaches ``settles_as``."""
    client = Client(conn)
    reply_to = client.new_reply_stream()
    store = MessageStore(conn)
    async with http_agent("crash") as agent, running_dispatcher(conn) as dispatcher:
        doomed = start(
            sidecar_args(agent, *extra),
            process_env(settings, AGENT_REACH_FAILPOINTS=f"{failpoint}=kill"),
            tmp_path / "sidecar1.log",
        )
        await registered(conn, "crash-1")

        async def routable() -> bool:  # the dispatcher has heard of it: the message is routed
            return "crash-1" in dispatcher.table.index.by_instance

        await eventually(routable, timeout_s=30)
        message_id = await client.submit(
            Envelope(capability="text.echo", reply_to=reply_to, payload=msgspec.Raw(b'{"n": 1}'))
        )
        assert await exited(doomed) == -signal.SIGKILL
        record = await store.get_record(message_id)
        assert record is not None
        stage_at_crash = record.stage
        restarted = start(
            sidecar_args(agent, *extra), process_env(settings), tmp_path / "sidecar2.log"
        )
        try:

            async def settled() -> bool:
                found = await store.get_record(message_id)
                return found is not None and found.stage is settles_as

            await eventually(settled, timeout_s=30)
            if settles_as is Stage.SUCCEEDED:
                (result,) = (await collect_replies(conn, reply_to, 1)).values()
                assert result.result == {"agent": "crash", "echo": {"n": 1}}
        finally:
            assert stop(restarted) == 0  # SIGTERM: a graceful stop
    timeline = [e.stage for e in await store.get_timeline(message_id)]
    return agent, message_id, timeline, stage_at_crash


@pytest.mark.timeout(120)
async def test_killed_after_received_before_processing_runs_exactly_once(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    agent, message_id, timeline, at_crash = await crash_then_restart(
        conn, settings, tmp_path, "sidecar.after_received"
    )
    assert at_crash is Stage.RECEIVED
    assert agent.log.calls[message_id] == 1  # executed exactly once
    assert timeline == [
        Stage.ACCEPTED,
        Stage.ROUTED,
        Stage.RECEIVED,
        Stage.PROCESSING,
        Stage.SUCCEEDED,
    ]


@pytest.mark.timeout(120)
async def test_killed_after_processing_parks_a_non_idempotent_message(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    agent, message_id, timeline, at_crash = await crash_then_restart(
        conn,
        settings,
        tmp_path,
        "sidecar.after_processing",
        settles_as=Stage.NEEDS_CONFIRMATION,
    )
    assert at_crash is Stage.PROCESSING
    assert agent.log.calls[message_id] == 0  # never run again on a guess
    assert timeline[-1] is Stage.NEEDS_CONFIRMATION


@pytest.mark.timeout(120)
async def test_killed_after_processing_retries_an_idempotent_agent_with_the_same_key(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    agent, message_id, timeline, at_crash = await crash_then_restart(
        conn, settings, tmp_path, "sidecar.after_processing", "--idempotent"
    )
    assert at_crash is Stage.PROCESSING
    assert agent.log.calls[message_id] == 1
    assert agent.log.headers[-1]["x-reach-idempotency-key"] == message_id
    assert timeline[-1] is Stage.SUCCEEDED


async def test_sigterm_drains_and_deregisters(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    async with http_agent("crash") as agent:
        process = start(sidecar_args(agent), process_env(settings), tmp_path / "s.log")
        await registered(conn, "crash-1")
        assert stop(process) == 0
    assert await conn.call("EXISTS", conn.keys.card("crash-1")) == 0
    assert await conn.call("ZSCORE", conn.keys.agents, "crash-1") is None


@pytest.mark.timeout(120)
async def test_restarted_after_processing_asks_the_status_endpoint_before_parking(
    conn: Connection, settings: Settings, tmp_path: Path
) -> None:
    """Killed after PROCESSING; on restart the sidecar asks the agent's status endpoint, which
    says done: the result is recorded instead of parking the message for an operator."""

    async def status(request: Request) -> Response:
        return JSONResponse({"state": "done", "result": {"agent": "crash", "echo": {"n": 1}}})

    app = Starlette(routes=[Route("/status/{message_id}", status, methods=["GET"])])
    async with serve_app(app) as url:
        agent, message_id, timeline, at_crash = await crash_then_restart(
            conn,
            settings,
            tmp_path,
            "sidecar.after_processing",
            "--status-url",
            f"{url}status",
        )
    assert at_crash is Stage.PROCESSING
    assert timeline[-1] is Stage.SUCCEEDED and Stage.NEEDS_CONFIRMATION not in timeline
    # killed before its call: the agent was never called again — the result came from status
    assert agent.log.calls[message_id] == 0
