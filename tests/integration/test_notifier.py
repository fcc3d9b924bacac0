"""The notifier against real Redis and a real webhook receiver on loopback (issue 6, point 2).

Deliveries are driven by outbox entries built by :func:`broker.results.delivery_commands`, as
whoever ends a message builds them; one test runs a message end to end instead.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from redis.exceptions import ResponseError
from starlette.applications import Starlette

from adapters.asgi import serve_app
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope, complete
from broker.keyspace import NOTIFY_GROUP
from broker.results import delivery_commands
from broker.stages import Stage
from broker.store import MessageStore, pairs
from broker.timeline import CALLBACK_DELIVERED
from tests.support.agents import http_agent
from tests.support.harness import eventually, running_dispatcher, running_sidecar
from tests.support.processes import process_env, start, stop
from tests.support.webhooks import SECRET, Receiver, readme_verify, serving, signature_ok
from workers.notifier import Notifier, backoff_ms

# -- fixtures and helpers --------------------------------------------------------------------


def hook_settings(settings: Settings, **changes: Any) -> Settings:
    base: dict[str, Any] = {
        "webhook_secret": SECRET,
        "callback_hosts": ["127.0.0.1"],
        "webhook_backoff_ms": 50,
        "webhook_backoff_max_ms": 1000,
        "webhook_timeout_s": 2.0,
        "webhook_attempts": 6,
        "claim_idle_s": 0.5,
    }
    return msgspec.structs.replace(settings, **(base | changes))


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[Connection]:
    assert settings.redis_url is not None
    async with open_connection(settings, settings.redis_url) as conn:
        yield conn


@asynccontextmanager
async def running_notifier(conn: Connection, name: str = "n1") -> AsyncIterator[Notifier]:
    notifier = Notifier(conn, consumer=name)
    async with anyio.create_task_group() as tg:
        await tg.start(notifier.run)
        yield notifier
        tg.cancel_scope.cancel()


async def ended_message(
    conn: Connection, url: str, *, with_timeline: bool = True
) -> tuple[str, bytes]:
    """A message that SUCCEEDED with a callback_url: its timeline (expiring, like a terminal
    record's) and the outbox entry, exactly as whoever ended it writes them. Returns its id
    and the body the webhook should receive."""
    envelope = complete(
        Envelope(capability="text.echo", payload=msgspec.Raw(b"{}"), callback_url=url)
    )
    message_id = envelope.message_id
    if with_timeline:
        item = msgspec.json.encode([str(int(time.time() * 1000)), "SUCCEEDED", "a-1", "1", ""])
        await conn.call_many(
            [
                (
                    "HSET",
                    conn.keys.record(message_id),
                    "stage",
                    "SUCCEEDED",
                    "attempt",
                    1,
                    "instance",
                    "a-1",
                ),
                ("RPUSH", conn.keys.timeline(message_id), item),
                ("EXPIRE", conn.keys.timeline(message_id), 600),
            ]
        )
    (command,) = delivery_commands(
        conn.keys, envelope, Stage.SUCCEEDED, b'{"ok":true}', None, attempt=1
    )
    await conn.call(*command)
    fields = dict(zip(command[3::2], command[4::2], strict=True))
    return message_id, fields["body"]


async def outbox_settled(conn: Connection) -> bool:
    """Nothing left to deliver: no entry in the outbox, none pending."""
    length, pending = await conn.call_many(
        [("XLEN", conn.keys.outbox), ("XPENDING", conn.keys.outbox, NOTIFY_GROUP)]
    )
    return int(length) == 0 and int(pending[0]) == 0


async def dead_letters(conn: Connection) -> list[dict[bytes, bytes]]:
    return [pairs(flat) for _, flat in await conn.call("XRANGE", conn.keys.dlq, "-", "+")]


async def events(conn: Connection, message_id: str) -> list[str]:
    return [str(e.stage) for e in await MessageStore(conn).get_timeline(message_id)]


async def pending_with(conn: Connection, consumer: str) -> list[str]:
    try:
        rows = await conn.call("XPENDING", conn.keys.outbox, NOTIFY_GROUP, "-", "+", 100, consumer)
    except ResponseError:  # NOGROUP: no notifier has started yet
        return []
    return [row[0].decode() for row in rows]


async def held_attempts(conn: Connection, consumer: str) -> list[str]:
    """The ``attempt`` of each entry pending with ``consumer``: ``["2"]`` once it holds the
    retry of a first attempt it has settled."""
    attempts = []
    for entry_id in await pending_with(conn, consumer):
        for _, flat in await conn.call("XRANGE", conn.keys.outbox, entry_id, entry_id):
            attempts.append(pairs(flat)[b"attempt"].decode())
    return attempts


# -- the tests -------------------------------------------------------------------------------


async def test_receiver_failing_three_times_gets_the_fourth_signed(settings: Settings) -> None:
    receiver = Receiver(answers=[500, 500, 500])
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                message_id, body = await ended_message(conn, url)

                async def noted() -> bool:
                    return CALLBACK_DELIVERED in await events(conn, message_id)

                await eventually(noted, timeout_s=20)
                await eventually(lambda: outbox_settled(conn), timeout_s=5)

            timeline = await MessageStore(conn).get_timeline(message_id)
            ttl = int(await conn.call("TTL", conn.keys.timeline(message_id)))
            letters = await dead_letters(conn)

    assert [h.status for h in receiver.hits] == [500, 500, 500, 200]
    attempts = [h.headers["x-reach-delivery-attempt"] for h in receiver.hits]
    assert attempts == ["1", "2", "3", "4"]
    fourth = receiver.hits[3]
    assert receiver.accepted == [fourth]
    assert signature_ok(fourth)
    assert fourth.headers["x-reach-message-id"] == message_id
    assert fourth.headers["content-type"] == "application/json"
    assert fourth.body == body
    assert msgspec.json.decode(body) == {
        "id": message_id,
        "stage": "SUCCEEDED",
        "attempt": 1,
        "result": {"ok": True},
    }
    # the same snippet refuses a body that was tampered with
    stamp, sig = fourth.headers["x-reach-timestamp"], fourth.headers["x-reach-signature"]
    assert not readme_verify()(SECRET.encode(), body + b" ", stamp, sig)
    # exponential back-off: wait n (from 0) lasts at least base·2^n, less the jitter
    gaps = [b.at - a.at for a, b in zip(receiver.hits, receiver.hits[1:], strict=False)]
    assert all(gap >= 0.8 * 0.050 * 2**n for n, gap in enumerate(gaps)), gaps
    assert [str(e.stage) for e in timeline] == ["SUCCEEDED", CALLBACK_DELIVERED]
    assert "answered 200 (attempt 4)" in timeline[-1].reason
    assert (timeline[-1].instance, timeline[-1].attempt) == ("a-1", 1)
    assert 0 < ttl <= 600  # the event did not make the timeline immortal
    assert letters == []


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("failure", ["hangs", "refuses"])
async def test_receiver_that_never_answers_ends_in_the_dlq(
    settings: Settings, failure: str
) -> None:
    receiver = Receiver(hang=True)
    changes = {"webhook_attempts": 3, "webhook_timeout_s": 0.3}
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, **changes)) as conn:
            # nothing listens on a port once its server has stopped: connections are refused
            async with serve_app(Starlette()) as stopped:
                pass
            async with serving(receiver) as live, running_notifier(conn):
                url = live if failure == "hangs" else f"{stopped}hook"
                message_id, body = await ended_message(conn, url)

                async def dead() -> bool:
                    return bool(await dead_letters(conn))

                await eventually(dead, timeout_s=20)
                await eventually(lambda: outbox_settled(conn), timeout_s=5)

            (letter,) = await dead_letters(conn)
            timeline = await events(conn, message_id)

    assert letter[b"id"].decode() == message_id
    assert letter[b"reason"] == b"callback_undeliverable"
    assert letter[b"url"].decode() == url
    assert letter[b"attempts"] == b"3"
    assert letter[b"stage"] == b"SUCCEEDED"
    assert letter[b"body"] == body
    if failure == "hangs":
        assert letter[b"error"] == b"no answer within 0.3 s"
        assert len(receiver.hits) == 3
        assert all(signature_ok(h) for h in receiver.hits)
    else:
        assert letter[b"error"].startswith(b"ConnectError")
        assert receiver.hits == []
    assert CALLBACK_DELIVERED not in timeline


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    "changes",
    [{"callback_hosts": ["hooks.example.com"]}, {"webhook_secret": None}],
    ids=["host-not-allowed", "no-secret"],
)
async def test_a_url_refused_at_send_time_is_dead_lettered_without_a_post(
    settings: Settings, changes: dict[str, Any]
) -> None:
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, **changes)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                message_id, _ = await ended_message(conn, url)

                async def dead() -> bool:
                    return bool(await dead_letters(conn))

                await eventually(dead, timeout_s=10)
                await eventually(lambda: outbox_settled(conn), timeout_s=5)
            (letter,) = await dead_letters(conn)

    assert letter[b"id"].decode() == message_id
    assert letter[b"reason"] == b"callback_undeliverable"
    assert letter[b"attempts"] == b"0"
    assert (b"not allowed" if "callback_hosts" in changes else b"webhook_secret") in letter[
        b"error"
    ]
    assert receiver.hits == []


async def test_delivery_does_not_recreate_an_expired_timeline(settings: Settings) -> None:
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                message_id, _ = await ended_message(conn, url, with_timeline=False)
                await eventually(lambda: outbox_settled(conn), timeout_s=10)
            exists = await conn.call("EXISTS", conn.keys.timeline(message_id))

    assert len(receiver.accepted) == 1
    assert receiver.accepted[0].headers["x-reach-message-id"] == message_id
    assert exists == 0


async def test_a_busy_receiver_s_retry_after_is_honoured(settings: Settings) -> None:
    receiver = Receiver(answers=[503], retry_after="1")  # 20 times the back-off base
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                await ended_message(conn, url)
                await eventually(lambda: outbox_settled(conn), timeout_s=10)

    assert [h.status for h in receiver.hits] == [503, 200]
    assert receiver.hits[1].at - receiver.hits[0].at >= 1.0


async def test_a_malformed_outbox_entry_is_dead_lettered(settings: Settings) -> None:
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn, running_notifier(conn):
            await conn.call("XADD", conn.keys.outbox, "*", "id", "m-1", "attempt", "1")

            async def dead() -> bool:
                return bool(await dead_letters(conn))

            await eventually(dead, timeout_s=10)
            await eventually(lambda: outbox_settled(conn), timeout_s=5)
            (letter,) = await dead_letters(conn)

    assert letter[b"id"] == b"m-1"
    assert letter[b"reason"] == b"callback_undeliverable"
    assert letter[b"error"].startswith(b"malformed outbox entry")


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("successor", ["n1", "n2"], ids=["restarted", "another"])
async def test_a_stopped_notifier_loses_nothing_a_new_one_delivers(
    settings: Settings, successor: str
) -> None:
    receiver = Receiver(answers=[500])
    # the retry waits 2 s (± jitter): long past claim_idle_s, so the takeover happens mid-wait
    changes = {"webhook_backoff_ms": 2000, "webhook_backoff_max_ms": 2000, "claim_idle_s": 0.3}
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, **changes)) as conn, serving(receiver) as url:
            async with running_notifier(conn, "n1") as first:
                message_id, _ = await ended_message(conn, url)

                async def waiting_out_its_backoff() -> bool:
                    return await held_attempts(conn, "n1") == ["2"] and first.holding == 1

                await eventually(waiting_out_its_backoff, timeout_s=10)
            # stopped: the retry is still pending with n1, and nobody has POSTed it
            (held,) = await pending_with(conn, "n1")
            ((_, flat),) = await conn.call("XRANGE", conn.keys.outbox, held, held)
            not_before_ms = int(pairs(flat)[b"not_before_ms"])
            assert len(receiver.hits) == 1

            async with running_notifier(conn, successor) as second:

                async def delivered() -> bool:
                    return bool(receiver.accepted) and await outbox_settled(conn)

                await eventually(delivered, timeout_s=20)
            timeline = await events(conn, message_id)

    assert second.handled == {"delivered": 1}
    assert [h.status for h in receiver.hits] == [500, 200]
    second_hit = receiver.hits[1]
    assert second_hit.headers["x-reach-delivery-attempt"] == "2"
    assert signature_ok(second_hit)
    assert second_hit.wall * 1000 >= not_before_ms - 1  # the back-off outlived the takeover
    assert CALLBACK_DELIVERED in timeline


async def test_a_held_entry_is_not_stolen_while_its_holder_lives(settings: Settings) -> None:
    receiver = Receiver(answers=[500])
    # the retry waits 1.5 s, five times claim_idle_s: without renewal the other notifier's
    # XAUTOCLAIM would take it, and both would POST attempt 2
    changes = {"webhook_backoff_ms": 1500, "webhook_backoff_max_ms": 1500, "claim_idle_s": 0.3}
    with anyio.fail_after(30):
        async with (
            connected(hook_settings(settings, **changes)) as conn,
            serving(receiver) as url,
            running_notifier(conn, "n1") as one,
            running_notifier(conn, "n2") as two,
        ):
            await ended_message(conn, url)

            async def all_settled() -> bool:
                return (
                    bool(receiver.accepted)
                    and await outbox_settled(conn)
                    and one.holding == 0
                    and two.holding == 0
                )

            await eventually(all_settled, timeout_s=20)

    assert [h.headers["x-reach-delivery-attempt"] for h in receiver.hits] == ["1", "2"]
    assert one.handled.get("delivered", 0) + two.handled.get("delivered", 0) == 1


async def test_a_sigkilled_notifier_process_loses_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    receiver = Receiver(answers=[500])
    changes = {"webhook_backoff_ms": 3000, "webhook_backoff_max_ms": 3000, "claim_idle_s": 0.5}
    hooked = hook_settings(settings, **changes)
    env = process_env(
        hooked,
        AGENT_REACH_WEBHOOK_SECRET=SECRET,
        AGENT_REACH_CALLBACK_HOSTS="127.0.0.1",
        AGENT_REACH_WEBHOOK_BACKOFF_MS="3000",
        AGENT_REACH_WEBHOOK_BACKOFF_MAX_MS="3000",
    )
    with anyio.fail_after(60):
        async with connected(hooked) as conn, serving(receiver) as url:
            process = start(["notifier", "--consumer", "doomed"], env, tmp_path / "notifier.log")
            try:
                message_id, _ = await ended_message(conn, url)

                async def holding_a_retry() -> bool:
                    return await held_attempts(conn, "doomed") == ["2"]

                await eventually(holding_a_retry, timeout_s=30)
                process.send_signal(signal.SIGKILL)
            finally:
                stop(process)
            assert process.returncode == -signal.SIGKILL
            async with running_notifier(conn, "heir"):

                async def delivered() -> bool:
                    return bool(receiver.accepted) and await outbox_settled(conn)

                await eventually(delivered, timeout_s=20)
            timeline = await events(conn, message_id)

    assert [h.headers["x-reach-delivery-attempt"] for h in receiver.hits] == ["1", "2"]
    assert signature_ok(receiver.hits[1])
    assert CALLBACK_DELIVERED in timeline


async def test_a_message_with_a_callback_url_end_to_end(settings: Settings) -> None:
    receiver = Receiver()
    with anyio.fail_after(60):
        async with connected(hook_settings(settings)) as conn:
            async with (
                serving(receiver) as url,
                http_agent("echo") as agent,
                running_sidecar(conn, "echo-1", ("text.echo",), url=agent.url),
                running_dispatcher(conn),
                running_notifier(conn),
            ):
                payload = msgspec.Raw(msgspec.json.encode({"x": 1}))
                message_id = await Client(conn).submit(
                    Envelope(capability="text.echo", payload=payload, callback_url=url)
                )

                async def noted() -> bool:
                    return CALLBACK_DELIVERED in await events(conn, message_id)

                await eventually(noted, timeout_s=30)
            timeline = await events(conn, message_id)

    (hit,) = receiver.hits
    assert signature_ok(hit)
    assert hit.headers["x-reach-message-id"] == message_id
    assert msgspec.json.decode(hit.body) == {
        "id": message_id,
        "stage": "SUCCEEDED",
        "attempt": 1,
        "result": {"agent": "echo", "echo": {"x": 1}},
    }
    happy = (Stage.ACCEPTED, Stage.ROUTED, Stage.RECEIVED, Stage.PROCESSING, Stage.SUCCEEDED)
    assert timeline == [*(s.value for s in happy), CALLBACK_DELIVERED]


def test_backoff_doubles_up_to_its_cap_with_bounded_jitter() -> None:
    rng = random.Random(7)
    for attempt, expected in [(1, 100), (2, 200), (3, 400), (4, 800), (5, 1000), (40, 1000)]:
        waits = [
            backoff_ms(attempt, base_ms=100, cap_ms=1000, jitter=0.2, rng=rng) for _ in range(200)
        ]
        assert min(waits) >= int(expected * 0.8)
        assert max(waits) <= min(1000, int(expected * 1.2))
        assert len(set(waits)) > 1  # spread: receivers back from an outage are not hit at once
