"""Fleet events (issue 16, section 4) against a real Redis, real sidecars and real HTTP
agents and receivers on loopback: what is emitted where, subscriptions delivered as signed
webhooks with retries, ``agent-reach events`` (and ``--follow``), the cap."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner, Result
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.envelope import Envelope
from broker.event_log import emit, event_command, events_key, recent_events
from broker.events import Event, event_fields
from broker.governance import EventSubscription, RateLimit, RateLimits
from broker.keyspace import FleetKeys
from broker.records import InstanceCard, InstanceState, InstanceStats
from broker.registry import Registry
from broker.stages import Stage
from broker.store import MessageStore
from broker.streams import parse_entries
from tests.conftest import suite_redis_binary
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
from workers.reaper import Reaper


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


def detail_of(event: Event) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(event.detail)
    return decoded


async def card_field(conn: Connection, instance_id: str, name: str) -> bytes | None:
    value: bytes | None = await conn.call("HGET", conn.keys.card(instance_id), name)
    return value


@pytest.mark.timeout(60)
async def test_a_circuit_that_opened_closes_again_once_the_agent_answers(
    settings: Settings,
) -> None:
    # Errors alone never make the instance DOWN here (a DOWN instance gets no probe); its
    # circuit opens after 4 failures, for 1 s, and closes after 2 successes half-open.
    quick = msgspec.structs.replace(
        settings,
        retry_limit=0,
        circuit_min_requests=4,
        circuit_open_s=1.0,
        circuit_probes=2,
        cooldown_s=0.1,
        down_error_rate=1.0,
    )
    broken = True

    async def flaky(envelope: dict[str, Any], request: Request) -> Response | None:
        return JSONResponse({"error": "broken"}, status_code=500) if broken else None

    async with (
        connected(quick) as conn,
        http_agent("flaky", behaviour=flaky) as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "flaky-1", ("text.echo",), url=agent.url),
        Client(conn) as client,
    ):
        for _ in range(4):
            await client.submit(echo())
        await eventually(has(conn, "circuit.opened", "flaky-1"), timeout_s=20)
        assert not await events_of(conn, "circuit.closed", "flaky-1")
        broken = False

        async def closed() -> bool:
            # real work through the broker: once the open second is over, these are the probes
            assert (await client.request("text.echo", {}, timeout=10)).ok
            return bool(await events_of(conn, "circuit.closed", "flaky-1"))

        await eventually(closed, timeout_s=20, interval_s=0.05)
        (opened,) = await events_of(conn, "circuit.opened", "flaky-1")
        (closing,) = await events_of(conn, "circuit.closed", "flaky-1")
        assert await card_field(conn, "flaky-1", "circuit") == b"closed"
    assert tuple(map(int, opened.id.split("-"))) < tuple(map(int, closing.id.split("-")))
    until_ms = detail_of(opened)["until_ms"]
    assert opened.ts < until_ms <= closing.ts  # closed only after the open time was over
    detail = detail_of(closing)
    assert set(detail) == {"error_rate", "requests"}
    assert detail["requests"] >= 6 and 0 < detail["error_rate"] < 1  # 4 failures, 2+ probes


@pytest.mark.timeout(60)
async def test_a_silent_instance_is_reported_down_once_by_the_reaper(settings: Settings) -> None:
    quick = msgspec.structs.replace(settings, heartbeat_s=0.2, down_after_s=1.0)
    async with (
        connected(quick) as conn,
        http_agent("echo") as agent,
        running_sidecar(conn, "live-1", ("text.echo",), url=agent.url),
    ):
        reaper = Reaper(conn)  # ticked here, as its loop would: each tick is a real pass
        async with running_sidecar(conn, "quiet-1", ("text.echo",), url=agent.url):
            await eventually(has(conn, "instance.registered", "quiet-1"))
            await reaper.tick()
            assert not await events_of(conn, "instance.state_changed", "quiet-1")
        # leaving the block cancels the sidecar: it dies without deregistering, its card
        # stays UP and no heartbeat comes any more

        async def reported() -> bool:
            await reaper.tick()
            return bool(await events_of(conn, "instance.state_changed", "quiet-1"))

        await eventually(reported, timeout_s=15, interval_s=0.1)
        for _ in range(3):  # later passes find it dead still, and say nothing more
            await reaper.tick()
        changed = await events_of(conn, "instance.state_changed", "quiet-1")
        last_beat = await card_field(conn, "quiet-1", "hb_ms")
        state = await card_field(conn, "quiet-1", "state")
        live = await events_of(conn, "instance.state_changed", "live-1")
    assert len(changed) == 1, changed
    (silent,) = changed
    detail = detail_of(silent)
    assert detail == {
        "from": "UP",
        "to": "DOWN",
        "reason": "silent",
        "last_heartbeat_ms": int(last_beat or 0),
    }
    assert silent.ts - detail["last_heartbeat_ms"] > 1000  # silent past down_after_s
    assert state == b"UP"  # the card is not rewritten: it still says what the sidecar wrote
    assert [e for e in live if detail_of(e).get("reason") == "silent"] == []


@pytest.mark.timeout(60)
async def test_an_instance_gone_for_good_is_forgotten_with_an_event(settings: Settings) -> None:
    quick = msgspec.structs.replace(
        settings,
        heartbeat_s=0.2,
        down_after_s=1.0,
        instance_gone_after_s=2.0,
        orphan_sweep_s=0.2,
    )
    async with (
        connected(quick) as conn,
        http_agent("echo") as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "live-1", ("text.echo",), url=agent.url),
    ):
        async with running_sidecar(conn, "lost-1", ("text.echo",), url=agent.url):
            await eventually(has(conn, "instance.registered", "lost-1"))
        # cancelled: dead without deregistering, its card and stream left behind
        assert await conn.call("EXISTS", conn.keys.card("lost-1")) == 1
        await eventually(has(conn, "instance.gone", "lost-1"), timeout_s=15)
        (gone,) = await events_of(conn, "instance.gone", "lost-1")
        silent = await events_of(conn, "instance.state_changed", "lost-1")
        left = [
            int(await conn.call("EXISTS", key))
            for key in (conn.keys.card("lost-1"), conn.keys.queue("lost-1"))
        ]
        registered = await conn.call("ZRANGE", conn.keys.agents, 0, -1)
        live_gone = await events_of(conn, "instance.gone", "live-1")
    assert detail_of(gone) == {"reason": "forgotten"}
    # said silent (DOWN) by the reaper first, forgotten once silent for instance_gone_after_s
    assert [detail_of(e).get("reason") for e in silent] == ["silent"]
    assert silent[0].ts < gone.ts
    assert gone.ts - detail_of(silent[0])["last_heartbeat_ms"] >= 2000
    assert left == [0, 0] and registered == [b"live-1"]
    assert live_gone == []  # the live one, heard from all along, is kept


@pytest.mark.timeout(60)
@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("kind", "name"), [("agent", "lim"), ("capability", "text.echo")], ids=["agent", "capability"]
)
async def test_a_rate_limit_that_refuses_is_reported_saturated_once(
    settings: Settings, kind: str, name: str
) -> None:
    limit = {name: RateLimit("10/s", burst=2)}
    limits = RateLimits(agent=limit) if kind == "agent" else RateLimits(capability=limit)
    limited = msgspec.structs.replace(settings, rate_limits=limits)
    async with (
        connected(limited) as conn,
        http_agent("lim") as agent,
        running_dispatcher(conn),
        running_sidecar(conn, "lim-1", ("text.echo",), url=agent.url),
        Client(conn) as client,
    ):
        results: list[Any] = []

        async def one() -> None:
            results.append(await client.request("text.echo", {}, timeout=30))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(15):
                tg.start_soon(one)
        took = time.monotonic() - started
        saturated = await events_of(conn, "rate_limit.saturated")
    assert len(results) == 15 and all(r.ok for r in results), results
    assert took >= (15 - 2) / 10 - 0.2  # the limit held them: refusals happened, many
    # many refusals, one event: at most one a minute per limit; and the instances an agent
    # limit holds, which have no rate of their own, are not reported as saturated
    assert [e.subject for e in saturated] == [f"{kind}:{name}"]
    detail = detail_of(saturated[0])
    assert set(detail) == {"per_second", "burst", "retry_in_ms"}
    assert detail["per_second"] == 10.0 and detail["burst"] == 2
    assert 0 < detail["retry_in_ms"] <= 101  # within one emission interval (100 ms)


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
    too_long = await cli(hooks, "subscribe", "--url", "http://127.0.0.1:9/" + "a" * 2100)
    assert too_long.exit_code == 2 and "longer than 2048 characters" in too_long.output
    assert len(too_long.output) < 600  # the URL is quoted cut short
    unknown = await cli(hooks, "subscribe", "--url", "http://127.0.0.1:9/h", "--event", "x.y")
    assert unknown.exit_code == 2 and "instance.state_changed" in unknown.output
    secretless = msgspec.structs.replace(hooks, webhook_secret=None)
    refused = await cli(secretless, "subscribe", "--url", "http://127.0.0.1:9/h")
    assert refused.exit_code == 2 and "webhook_secret" in refused.output
    mixed = await cli(hooks, "subscribe", "--list", "--url", "http://127.0.0.1:9/h")
    assert mixed.exit_code == 2 and "--list lists: give it without --url" in mixed.output
    empty = await cli(hooks, "subscribe", "--list")
    assert empty.exit_code == 0 and empty.output == "no subscriptions\n"
    async with connected(settings) as conn:
        assert not await conn.call("HLEN", FleetKeys(conn.keys.prefix).subscriptions)


@pytest.mark.timeout(90)
async def test_a_subscription_s_password_is_not_printed(settings: Settings) -> None:
    """A URL may carry its endpoint's password: `subscribe` and `subscribe --list` printed
    it as stored, where `config` hides it."""
    hooks = hooked(settings)
    made = await cli(hooks, "subscribe", "--url", "http://hook:s3cret@127.0.0.1:9/h")
    assert made.exit_code == 0 and "s3cret" not in made.output, made.output
    for argv in (["--list"], ["--list", "--json"]):
        listed = await cli(hooks, "subscribe", *argv)
        assert "http://hook:<hidden>@127.0.0.1:9/h" in listed.output, listed.output
        assert "s3cret" not in listed.output


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


async def line_of(pipe: IO[bytes]) -> bytes:
    """The next line a child process writes to ``pipe``, read on a thread, within 30 s."""
    with anyio.fail_after(30):
        return await anyio.to_thread.run_sync(pipe.readline, abandon_on_cancel=True)


def following(settings: Settings, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """``agent-reach events --follow --json``, its stdout a pipe (read it on a thread)."""
    return subprocess.Popen(
        [AGENT_REACH, "events", "--follow", "--json"],
        env=process_env(settings),
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


async def test_no_recent_events_asked_for_still_follows_from_the_newest(conn: Connection) -> None:
    """``events --follow --count 0``: nothing old printed, and following starts after the
    newest event, not from the beginning of the stream."""
    await emit(conn, [event_command(conn, "instance.gone", f"old-{n}") for n in range(3)])
    shown, after = await recent_events(conn, 0)
    newest = parse_entries(await conn.call("XREVRANGE", events_key(conn), "+", "-", "COUNT", 1))
    assert shown == [] and after == newest[0][0]


@pytest.mark.timeout(60)
async def test_events_follow_prints_what_arrives_after_it_started(
    settings: Settings, tmp_path: Path
) -> None:
    async with connected(settings) as conn:
        await emit(conn, [event_command(conn, "instance.gone", "before-1")])
        follower = following(settings)
        try:
            assert follower.stdout is not None
            first = await line_of(follower.stdout)
            assert json.loads(first)["subject"] == "before-1"
            deadline = time.monotonic() + 30
            await emit(conn, [event_command(conn, "instance.gone", "after-1")])
            line = await line_of(follower.stdout)
            assert time.monotonic() < deadline and json.loads(line)["subject"] == "after-1"
        finally:
            follower.terminate()
            code = await anyio.to_thread.run_sync(lambda: follower.wait(30))
            if follower.stdout is not None:
                follower.stdout.close()
        assert code == 0


@dataclass
class Outage:
    """``events --follow`` (``--json``) on a Redis of its own that it saw go away and come
    back: its pipes, the line it said on stderr when Redis went, and the Redis now."""

    out: IO[bytes]
    err: IO[bytes]
    away: bytes
    settings: Settings
    code: int | None = None  # the follower's exit code, once the block has ended


@asynccontextmanager
async def followed_through_an_outage(
    settings: Settings, tmp_path: Path, *, back_from: str
) -> AsyncIterator[Outage]:
    """The follower prints an event, Redis stops and starts again on its port from the data
    directory ``back_from`` ("redis": its own, AOF and all); terminated when the block ends."""
    binary = suite_redis_binary()
    server = RedisServer.start(tmp_path / "redis", binary=binary)
    own = msgspec.structs.replace(settings, redis_url=server.url)
    follower = following(own, stderr=subprocess.PIPE)
    try:
        assert follower.stdout is not None and follower.stderr is not None
        async with open_connection(own, server.url) as conn:
            await emit(conn, [event_command(conn, "instance.gone", "before")])
        assert json.loads(await line_of(follower.stdout))["subject"] == "before"
        server.stop()  # everysec: the event stream is on disk, and comes back with Redis
        away = await line_of(follower.stderr)
        server = RedisServer.start(tmp_path / back_from, binary=binary, port=server.port)
        outage = Outage(follower.stdout, follower.stderr, away, own)
        yield outage
        assert follower.poll() is None  # still following
    finally:
        follower.terminate()
        code = await anyio.to_thread.run_sync(lambda: follower.wait(30))
        for pipe in (follower.stdout, follower.stderr):
            if pipe is not None:
                pipe.close()
        server.stop()
    outage.code = code


@pytest.mark.timeout(90)
async def test_events_follow_waits_through_a_redis_restart_and_goes_on(
    settings: Settings, tmp_path: Path
) -> None:
    """Redis restarts under ``events --follow``: it says so once on stderr, says when Redis is
    back, and prints what is written after that, from where it was (nothing twice), without
    being started again."""
    async with followed_through_an_outage(settings, tmp_path, back_from="redis") as o:
        back = await line_of(o.err)
        async with open_connection(o.settings, o.settings.redis_url) as conn:
            await emit(conn, [event_command(conn, "instance.gone", "after")])
        after = await line_of(o.out)
    assert o.away.startswith(b"Redis is unavailable (") and back.startswith(b"Redis at ")
    assert json.loads(after)["subject"] == "after"  # not "before" again
    assert o.code == 0


async def test_a_beat_late_after_deregistering_does_not_list_the_instance_again(
    conn: Connection,
) -> None:
    """A sidecar's last heartbeat may reach Redis after its deregistration (the two leave on
    different connections): the beat finds no card and lists nothing."""
    registry = Registry(conn)
    card = InstanceCard(
        agent_id="late",
        instance_id="late-1",
        capabilities=("text.echo",),
        endpoint="http://127.0.0.1:9/",
        max_inflight=4,
    )
    await registry.register(card, credits=4)
    assert [v.instance_id for v in await registry.snapshot()] == ["late-1"]
    await registry.deregister("late-1")
    assert await registry.heartbeat("late-1", InstanceState.UP, InstanceStats()) is None
    assert await registry.snapshot() == []
    assert await conn.call("ZSCORE", conn.keys.agents, "late-1") is None
    await registry.register(card, credits=4)  # coming back is registering again
    assert [v.instance_id for v in await registry.snapshot()] == ["late-1"]


@pytest.mark.timeout(60)
async def test_events_follow_reads_a_stream_that_came_back_without_its_data_from_its_start(
    settings: Settings, tmp_path: Path
) -> None:
    """Redis comes back empty (no AOF, or a failover to a node without the events): the
    follower says so and reads the new stream from its start: an event whose id falls below
    the last one read (a node whose clock is behind) is printed, not skipped."""
    async with followed_through_an_outage(settings, tmp_path, back_from="empty") as o:
        async with open_connection(o.settings, o.settings.redis_url) as conn:
            # an event by a clock an hour behind: its id is below the last one read (written
            # before or after the follower looks again: it is printed either way)
            behind_ms = int(time.time() * 1000) - 3_600_000
            fields = event_fields("instance.gone", "behind", behind_ms)
            flat = itertools.chain.from_iterable(fields.items())
            await conn.call("XADD", events_key(conn), f"{behind_ms}-0", *flat)
        back, note = await line_of(o.err), await line_of(o.err)
        after = await line_of(o.out)
    assert o.away.startswith(b"Redis is unavailable (") and back.startswith(b"Redis at ")
    assert note.startswith(b"note: the event stream is ")  # gone, or a new one
    assert json.loads(after)["subject"] == "behind"
    assert o.code == 0
