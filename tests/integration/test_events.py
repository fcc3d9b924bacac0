"""Fleet events (issue 16, section 4) against a real Redis, real sidecars and real HTTP
agents and receivers on loopback: what is emitted where, subscriptions delivered as signed
webhooks with retries, ``agent-reach events`` (and ``--follow``), the cap."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner, Result
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope
from broker.event_log import emit, event_command, events_key, recent_events
from broker.events import Event
from broker.governance import EventSubscription
from broker.keyspace import FleetKeys
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import (
    connected,
    eventually,
    running_dispatcher,
    running_notifier,
    running_sidecar,
)
from tests.support.processes import AGENT_REACH, process_env
from tests.support.webhooks import SECRET, Receiver, serving, signature_ok
from workers.cli import main


def hooked(settings: Settings, **changes: Any) -> Settings:
    base: dict[str, Any] = {
        "webhook_secret": SECRET,
        "callback_hosts": ["127.0.0.1"],
        "webhook_backoff_ms": 50,
        "webhook_backoff_max_ms": 500,
        "claim_idle_s": 0.5,
    }
    return msgspec.structs.replace(settings, **(base | changes))


def cli_env(settings: Settings) -> dict[str, str]:
    return process_env(
        settings,
        AGENT_REACH_WEBHOOK_SECRET=settings.webhook_secret or "",
        AGENT_REACH_CALLBACK_HOSTS=",".join(settings.callback_hosts),
    )


async def cli(settings: Settings, *args: str) -> Result:
    """``agent-reach ARGS`` in-process (its own event loop, on a thread)."""
    env = cli_env(settings)
    return await anyio.to_thread.run_sync(lambda: CliRunner().invoke(main, list(args), env=env))


async def events_of(conn: Connection, kind: str, subject: str | None = None) -> list[Event]:
    found, _ = await recent_events(conn, 10_000, [kind])
    return [e for e in found if subject is None or e.subject == subject]


def has(conn: Connection, kind: str, subject: str | None = None) -> Any:
    async def check() -> bool:
        return bool(await events_of(conn, kind, subject))

    return check


def echo() -> Envelope:
    return Envelope(capability="text.echo", payload=msgspec.Raw(b"{}"))


async def failing(envelope: dict[str, Any], request: Request) -> Response:
    return JSONResponse({"error": "broken"}, status_code=500)


def accepted(receiver: Receiver, count: int) -> Any:
    async def check() -> bool:
        return len(receiver.accepted) >= count

    return check


# -- emission --------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_a_sidecar_registers_opens_its_circuit_goes_down_and_drains(
    settings: Settings,
) -> None:
    quick = msgspec.structs.replace(settings, circuit_min_requests=4, retry_limit=0)
    async with (
        connected(quick) as conn,
        http_agent("bad", behaviour=failing) as agent,
        running_dispatcher(conn),
    ):
        async with running_sidecar(conn, "bad-1", ("text.echo",), url=agent.url) as sidecar:
            await eventually(has(conn, "instance.registered", "bad-1"))
            (registered,) = await events_of(conn, "instance.registered", "bad-1")
            detail = msgspec.json.decode(registered.detail)
            assert detail["agent"] == "bad" and detail["capabilities"] == ["text.echo"]
            client = Client(conn)
            for _ in range(8):
                await client.submit(echo())
            await eventually(has(conn, "circuit.opened", "bad-1"))
            await eventually(has(conn, "instance.state_changed", "bad-1"))
            changed = (await events_of(conn, "instance.state_changed", "bad-1"))[0]
            moved = msgspec.json.decode(changed.detail)
            assert moved["from"] == "UP" and moved["to"] in ("DEGRADED", "DOWN")
            sidecar.lifecycle.stop()
            await eventually(has(conn, "instance.drained", "bad-1"))
        gone = await events_of(conn, "instance.gone", "bad-1")
        assert [msgspec.json.decode(e.detail)["reason"] for e in gone] == ["deregistered"]


async def test_a_rejected_message_is_dead_lettered_with_an_event(settings: Settings) -> None:
    async with connected(settings) as conn, running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b"{not json")
        await eventually(has(conn, "message.dead"))
        (dead,) = await events_of(conn, "message.dead")
        detail = msgspec.json.decode(dead.detail)
        assert detail["stage"] == "REJECTED" and detail["label"] == "rejected"


@pytest.mark.timeout(60)
async def test_an_ambiguous_call_to_a_non_idempotent_agent_needs_confirmation(
    settings: Settings,
) -> None:
    quick = msgspec.structs.replace(settings, sync_call_timeout_s=0.5)
    async with (
        connected(quick) as conn,
        http_agent("slow", delay_s=5.0) as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "slow-1", ("text.echo",), url=agent.url, idempotent=False),
    ):
        message_id = await Client(conn).submit(echo())
        await eventually(has(conn, "message.needs_confirmation", message_id))
        (parked,) = await events_of(conn, "message.needs_confirmation", message_id)
        assert msgspec.json.decode(parked.detail)["instance"] == "slow-1"
        record = await MessageStore(conn).get_record(message_id)
        assert record is not None and record.stage is Stage.NEEDS_CONFIRMATION


async def test_the_stream_stays_capped(settings: Settings) -> None:
    capped = msgspec.structs.replace(settings, events_max=100)
    async with connected(capped) as conn:
        for _ in range(10):
            await emit(conn, [event_command(conn, "circuit.closed", "x-1") for _ in range(100)])
        # MAXLEN ~ trims whole nodes (100 entries each): about the cap, never the 1,000
        assert 100 <= await conn.call("XLEN", events_key(conn)) < 300


# -- subscriptions ---------------------------------------------------------------------------


async def test_subscribe_refuses_a_bad_url_an_unknown_type_and_no_secret(
    settings: Settings,
) -> None:
    hooks = hooked(settings)
    bad_url = await cli(
        hooks, "subscribe", "--url", "http://evil.example/x", "--event", "message.dead"
    )
    assert bad_url.exit_code == 2 and "not allowed" in bad_url.output
    not_http = await cli(hooks, "subscribe", "--url", "ftp://127.0.0.1/x")
    assert not_http.exit_code == 2 and "http://" in not_http.output
    unknown = await cli(hooks, "subscribe", "--url", "http://127.0.0.1:9/h", "--event", "x.y")
    assert unknown.exit_code == 2 and "instance.state_changed" in unknown.output
    secretless = msgspec.structs.replace(hooks, webhook_secret=None)
    refused = await cli(secretless, "subscribe", "--url", "http://127.0.0.1:9/h")
    assert refused.exit_code == 2 and "webhook_secret" in refused.output
    async with connected(settings) as conn:
        assert not await conn.call("HLEN", FleetKeys(conn.keys.prefix).subscriptions)


@pytest.mark.timeout(90)
async def test_subscribers_get_matching_events_signed_and_retried(settings: Settings) -> None:
    hooks = hooked(settings)
    receiver = Receiver(answers=[500])  # the first POST fails: the delivery is retried
    others = Receiver()
    async with serving(receiver) as url, serving(others) as other_url, connected(hooks) as conn:
        made = await cli(
            hooks, "subscribe", "--url", url, "--event", "instance.registered", "--json"
        )
        assert made.exit_code == 0, made.output
        sub_id = json.loads(made.output)["id"]
        also = await cli(hooks, "subscribe", "--url", other_url, "--event", "message.dead")
        assert also.exit_code == 0, also.output
        listed = await cli(hooks, "subscribe", "--list", "--json")
        assert {json.loads(line)["url"] for line in listed.output.splitlines()} == {url, other_url}
        async with running_notifier(conn), http_agent("echo") as agent:
            async with running_sidecar(conn, "echo-1", ("text.echo",), url=agent.url):
                await eventually(accepted(receiver, 1))
        assert [h.status for h in receiver.hits] == [500, 200]
        first, second = receiver.hits
        assert first.headers["webhook-id"] == second.headers["webhook-id"]
        assert second.headers["webhook-id"].endswith(f".{sub_id}")
        assert all(signature_ok(hit) for hit in receiver.hits)
        body = json.loads(second.body)
        assert body["type"] == "instance.registered" and body["subject"] == "echo-1"
        assert set(body) == {"type", "subject", "ts", "detail", "id"}
        assert others.hits == []  # no message was dead-lettered: nothing for message.dead
        removed = await cli(hooks, "unsubscribe", sub_id)
        assert removed.exit_code == 0
        assert (await cli(hooks, "unsubscribe", sub_id)).exit_code == 1


async def test_config_subscriptions_are_delivered_too(settings: Settings) -> None:
    receiver = Receiver()
    async with serving(receiver) as url:
        hooks = hooked(
            settings, event_subscriptions=[EventSubscription(url=url, events=["circuit.opened"])]
        )
        async with connected(hooks) as conn, running_notifier(conn):
            await emit(conn, [event_command(conn, "circuit.closed", "a-1")])
            await emit(conn, [event_command(conn, "circuit.opened", "a-1", until_ms=1)])
            await eventually(accepted(receiver, 1))
            assert json.loads(receiver.hits[0].body)["type"] == "circuit.opened"


async def test_an_unreadable_event_entry_is_skipped_and_the_relay_goes_on(
    settings: Settings,
) -> None:
    receiver = Receiver()
    async with serving(receiver) as url:
        hooks = hooked(settings, event_subscriptions=[EventSubscription(url=url)])
        async with connected(hooks) as conn, running_notifier(conn) as notifier:
            stream = events_key(conn)
            await conn.call("XADD", stream, "*", b"type\xff", b"\x00\xfe", "detail", b"[[[")
            await conn.call("XADD", stream, "*", "type", "circuit.opened", "subject", "a")
            await emit(conn, [event_command(conn, "message.dead", "m-1", reason="x")])
            await eventually(accepted(receiver, 1))
            assert notifier.relay.skipped == 2
            assert json.loads(receiver.hits[0].body)["subject"] == "m-1"
            pending = await conn.call("XPENDING", stream, "events")
            assert pending[0] == 0


# -- agent-reach events ----------------------------------------------------------------------


async def test_events_prints_json_lines_and_filters_by_type(settings: Settings) -> None:
    async with connected(settings) as conn:
        await emit(conn, [event_command(conn, "instance.gone", f"i-{n}") for n in range(3)])
        await emit(conn, [event_command(conn, "message.dead", "m-1", reason="r")])
        printed = await cli(settings, "events", "--json")
        assert printed.exit_code == 0, printed.output
        lines = [json.loads(line) for line in printed.output.splitlines()]
        assert [(e["type"], e["subject"]) for e in lines] == [
            *(("instance.gone", f"i-{n}") for n in range(3)),
            ("message.dead", "m-1"),
        ]
        last_two = await cli(settings, "events", "--type", "instance.gone", "--count", "2")
        assert [line.split()[2] for line in last_two.output.splitlines()] == ["i-1", "i-2"]
        bad = await cli(settings, "events", "--type", "nope.no")
        assert bad.exit_code == 2


@pytest.mark.timeout(60)
async def test_events_follow_prints_what_arrives_after_it_started(
    settings: Settings, tmp_path: Path
) -> None:
    async with connected(settings) as conn:
        await emit(conn, [event_command(conn, "instance.gone", "before-1")])
        follower = subprocess.Popen(  # noqa: ASYNC220 - read on a thread below
            [AGENT_REACH, "events", "--follow", "--json"],
            env=process_env(settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert follower.stdout is not None
            first = await anyio.to_thread.run_sync(follower.stdout.readline)
            assert json.loads(first)["subject"] == "before-1"
            deadline = time.monotonic() + 30
            await emit(conn, [event_command(conn, "instance.gone", "after-1")])
            line = await anyio.to_thread.run_sync(follower.stdout.readline)
            assert time.monotonic() < deadline and json.loads(line)["subject"] == "after-1"
        finally:
            follower.terminate()
            code = await anyio.to_thread.run_sync(lambda: follower.wait(30))
            if follower.stdout is not None:
                follower.stdout.close()
        assert code == 0
