"""``agent-reach request`` as a real subprocess, against in-process agents and dispatcher."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.config import Settings, answer_grace_s
from broker.connection import Connection
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import eventually, running_dispatcher, running_sidecar
from tests.support.processes import AGENT_REACH, process_env
from tests.support.raw_http import raw_http
from workers.cli import main


async def cli(settings: Settings, *argv: str) -> tuple[int, str, str]:
    """``agent-reach ARGV``: exit code, stdout, stderr."""
    done = await anyio.run_process([AGENT_REACH, *argv], env=process_env(settings), check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def request(settings: Settings, *argv: str) -> tuple[int, str, str]:
    """``agent-reach request ARGV``."""
    return await cli(settings, "request", *argv)


async def reply_streams(conn: Connection) -> list[bytes]:
    cursor, found = b"0", []
    while True:
        cursor, keys = await conn.call("SCAN", cursor, "MATCH", f"{conn.keys.reply_prefix}*")
        found += keys
        if cursor == b"0":
            return list(found)


async def test_request_prints_the_result_and_exits_zero(
    conn: Connection, settings: Settings
) -> None:
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        code, out, err = await request(settings, "text.echo", "--payload", '{"x": 5}')
    assert code == 0, out + err
    result = json.loads(out)
    assert result["stage"] == "SUCCEEDED" and result["result"]["echo"] == {"x": 5}
    assert agent.log.calls[result["id"]] == 1
    assert await reply_streams(conn) == []  # the client deleted its reply stream on exit


async def test_request_exits_one_when_the_message_fails(
    conn: Connection, settings: Settings
) -> None:
    async def refuse(envelope: dict[str, Any], request: Request) -> Response | None:
        return JSONResponse({"detail": "order not found"}, status_code=404)

    async with (
        http_agent("a", behaviour=refuse) as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
        running_dispatcher(conn),
    ):
        code, out, err = await request(settings, "text.echo", "--payload", "[1, 2]")
    assert code == 1, out + err
    result = json.loads(out)
    assert result["stage"] == Stage.FAILED and "404" in result["error"]
    assert agent.log.total == 1


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("verb", ["request", "send --wait"])
async def test_exit_three_with_the_id_when_no_result_comes_by_the_deadline_and_grace(
    conn: Connection, settings: Settings, verb: str
) -> None:
    # nothing serves text.nobody, and no reaper runs to end it at its deadline
    async with running_dispatcher(conn, reaper=False):
        started = anyio.current_time()
        code, out, err = await cli(settings, *verb.split(), "text.nobody", "--timeout", "0.5")
        took = anyio.current_time() - started
    assert code == 3, out + err
    pending = json.loads(out)
    waited = 0.5 + answer_grace_s(settings)
    assert pending["stage"] == "PENDING" and pending["now"] == "WAITING"
    assert f"no result within {waited:g}s (the 0.5s deadline and" in pending["error"]
    assert f"agent-reach trace {pending['id']}" in pending["error"]
    assert took >= waited  # it waited past the deadline for the broker's answer
    store = MessageStore(conn)

    async def accepted() -> bool:  # the id names the message the dispatcher accepted
        return await store.get_record(pending["id"]) is not None

    await eventually(accepted)
    trace = await Client(conn).trace(pending["id"])
    assert trace.record.capability == "text.nobody"


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("verb", ["request", "send --wait"])
async def test_a_capability_nobody_serves_ends_expired_with_the_nearest_one(
    conn: Connection, settings: Settings, verb: str
) -> None:
    """The message expires at its 1 s deadline, and the answer — not a local timeout — says
    why, with what was probably meant."""
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("no.such-thing",), url=agent.url),
        running_dispatcher(conn),
    ):
        code, out, err = await cli(settings, *verb.split(), "no.such", "--timeout", "1")
    assert code == 1, out + err
    result = json.loads(out)
    assert result["stage"] == "EXPIRED"
    assert "no_capability_match: no instance serves 'no.such'" in result["error"]
    assert "nearest registered: no.such-thing" in result["error"]
    assert agent.log.total == 0


def test_request_refuses_a_payload_that_is_not_json() -> None:
    result = CliRunner().invoke(main, ["request", "text.echo", "--payload", '{"x": }'])
    assert result.exit_code == 2
    assert "Invalid value for --payload: not JSON: JSON is malformed" in result.output
    result = CliRunner().invoke(main, ["request", "Text", "--payload", "1"])
    assert result.exit_code == 2 and "domain.action" in result.output
    result = CliRunner().invoke(main, ["request", "text.echo", "--timeout", "-1"])
    assert result.exit_code == 2 and "--timeout" in result.output
    result = CliRunner().invoke(main, ["send", "text.echo", "--wait", "--timeout", "0"])
    assert result.exit_code == 2 and "--timeout" in result.output
    deep = "[" * 100 + "]" * 100
    for command in ("request", "send"):
        result = CliRunner().invoke(main, [command, "text.echo", "--payload", deep])
        assert result.exit_code == 2
        assert "--payload: JSON nested 100 levels deep; at most 64" in result.output
    assert "--redis URL" in CliRunner().invoke(main, ["request", "--help"]).output


async def test_a_request_parked_for_an_operator_says_so_at_its_deadline(
    conn: Connection, settings: Settings
) -> None:
    """The agent took the call and dropped the connection unanswered: the (non-idempotent)
    message is NEEDS_CONFIRMATION, and will not finish by itself. The PENDING line says it
    is, and who decides — it said "it may still finish"."""

    async def hang_up(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with (
        raw_http(hang_up) as (url, _),
        running_sidecar(conn, "a-1", ("text.echo",), url=url),
        running_dispatcher(conn),
    ):
        code, out, err = await request(settings, "text.echo", "--timeout", "1")
    assert code == 3, out + err
    pending = json.loads(out)
    assert pending["stage"] == "PENDING" and pending["now"] == "NEEDS_CONFIRMATION"
    assert "an operator decides (agent-reach resolve or replay)" in pending["error"]
