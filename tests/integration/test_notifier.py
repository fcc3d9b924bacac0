"""The notifier against real Redis and a real webhook receiver on loopback (issue 6, point 2;
issue 11, point 5: Standard Webhooks signatures, the egress guard, no redirects, any bytes in
the outbox).

Deliveries are driven by outbox entries built by :func:`broker.results.delivery_commands`, as
whoever ends a message builds them; one test runs a message end to end instead. Receivers
verify what they get with the README's snippet, through the ``standardwebhooks`` library.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from adapters.asgi import serve_app
from broker.client import Client
from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope, complete
from broker.errors import RedisReplyError
from broker.ids import new_message_id
from broker.keyspace import NOTIFY_GROUP, outbox_for, outboxes
from broker.record_codec import pairs
from broker.results import delivery_commands
from broker.stages import Stage
from broker.store import MessageStore
from broker.timeline import CALLBACK_DELIVERED
from broker.wire import OutboxEntry
from tests.support.agents import http_agent
from tests.support.harness import (
    connected,
    eventually,
    running_dispatcher,
    running_notifier,
    running_sidecar,
)
from tests.support.processes import process_env, start, stop
from tests.support.webhooks import (
    SECRET,
    WHSEC_SECRET,
    Receiver,
    legacy_signature_ok,
    readme_verify,
    serving,
    signature_ok,
)
from workers.notifier import Notifier
from workers.webhook_post import WebhookPoster
from workers.webhook_settlement import backoff_ms

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


def id_in(conn: Connection, outbox: str) -> str:
    """A fresh message id whose deliveries go to ``outbox`` (one partition of it)."""
    while outbox_for(conn.keys, message_id := new_message_id()) != outbox:
        pass
    return message_id


async def ended_message(
    conn: Connection,
    url: str,
    *,
    with_timeline: bool = True,
    attempt: int = 1,
    message_id: str | None = None,
) -> tuple[str, bytes]:
    """A message that SUCCEEDED (at ``attempt``) with a callback_url: its record with its
    timeline (expiring, as a terminal record does) and the outbox entry, exactly as whoever
    ended it writes them. Returns its id and the body the webhook should receive."""
    envelope = complete(
        Envelope(
            id=message_id, capability="text.echo", payload=msgspec.Raw(b"{}"), callback_url=url
        )
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
                    "timeline",
                    item,
                ),
                ("EXPIRE", conn.keys.record(message_id), 600),
            ]
        )
    (command,) = delivery_commands(
        conn.keys, envelope, Stage.SUCCEEDED, b'{"ok":true}', None, attempt=attempt
    )
    await conn.call(*command)
    fields = dict(zip(command[3::2], command[4::2], strict=True))
    return message_id, fields["body"]


async def outbox_settled(conn: Connection) -> bool:
    """Nothing left to deliver: no entry in the outbox, none pending."""
    return await stream_settled(conn, conn.keys.outbox)


async def stream_settled(conn: Connection, stream: str) -> bool:
    length, pending = await conn.call_many([("XLEN", stream), ("XPENDING", stream, NOTIFY_GROUP)])
    return int(length) == 0 and int(pending[0]) == 0


async def dead_letters(conn: Connection) -> list[dict[bytes, bytes]]:
    return [pairs(flat) for _, flat in await conn.call("XRANGE", conn.keys.dlq, "-", "+")]


async def events(conn: Connection, message_id: str) -> list[str]:
    return [str(e.stage) for e in await MessageStore(conn).get_timeline(message_id)]


async def pending_with(conn: Connection, consumer: str) -> list[str]:
    try:
        rows = await conn.call("XPENDING", conn.keys.outbox, NOTIFY_GROUP, "-", "+", 100, consumer)
    except RedisReplyError as exc:
        if exc.code != "NOGROUP":  # NOGROUP: no notifier has started yet
            raise
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


async def test_a_webhook_url_s_password_stays_off_the_timeline_and_the_log(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback URL may carry the receiver's password: the delivery's note on the
    timeline (shown by `trace` and the console) and the log lines wrote it out."""
    caplog.set_level(logging.INFO, logger="agent_reach.notifier")
    receiver = Receiver(answers=[500])
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                with_password = url.replace("http://", "http://hook:s3cret@", 1)
                message_id, _ = await ended_message(conn, with_password)

                async def noted() -> bool:
                    return CALLBACK_DELIVERED in await events(conn, message_id)

                await eventually(noted, timeout_s=20)
            timeline = await MessageStore(conn).get_timeline(message_id)

    assert len(receiver.hits) == 2  # the password went where it belongs: the request
    assert "http://hook:<hidden>@127.0.0.1:" in timeline[-1].reason
    assert "s3cret" not in timeline[-1].reason and "s3cret" not in caplog.text
    assert "hook:<hidden>@" in caplog.text  # the retry's line, and the delivery's


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
            ttl = int(await conn.call("TTL", conn.keys.record(message_id)))
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
    # one answer, one webhook-id, on every try
    assert {h.headers["webhook-id"] for h in receiver.hits} == {f"{message_id}.1"}
    # the README's verification refuses a tampered body, or a tampered id
    verify = readme_verify()
    assert verify(SECRET, body + b" ", fourth.headers) is None
    assert verify(SECRET, body, fourth.headers | {"webhook-id": f"{message_id}.2"}) is None
    # receivers written before Standard Webhooks still verify what they did
    assert legacy_signature_ok(fourth)
    assert fourth.headers["x-reach-timestamp"] == fourth.headers["webhook-timestamp"]
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
            exists = await conn.call("EXISTS", conn.keys.record(message_id))

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


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("retry_after", ["inf", "1e400", "nan", "Fri, 31 Dec 9999 23:59:59 GMT"])
async def test_a_retry_after_of_no_sensible_length_is_a_bounded_wait(
    settings: Settings, retry_after: str
) -> None:
    """Once a receiver's ``Retry-After: inf`` overflowed and stopped the whole process."""
    receiver = Receiver(answers=[503], retry_after=retry_after)
    changes = {"webhook_backoff_ms": 50, "webhook_backoff_max_ms": 200}
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, **changes)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                await ended_message(conn, url)
                await eventually(lambda: outbox_settled(conn), timeout_s=10)
    assert [h.status for h in receiver.hits] == [503, 200]


async def delivered_and_settled(conn: Connection, *receivers: Receiver) -> bool:
    return all(r.accepted for r in receivers) and await outbox_settled(conn)


# -- Standard Webhooks -----------------------------------------------------------------------


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("secret", [SECRET, WHSEC_SECRET], ids=["plain", "whsec"])
async def test_a_standard_webhooks_receiver_verifies_every_try_under_one_id(
    settings: Settings, secret: str
) -> None:
    receiver = Receiver(answers=[500, 503])
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, webhook_secret=secret)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                message_id, body = await ended_message(conn, url)
                await eventually(lambda: delivered_and_settled(conn, receiver), timeout_s=20)

    verify = readme_verify()
    assert [h.status for h in receiver.hits] == [500, 503, 200]
    assert [h.headers["webhook-id"] for h in receiver.hits] == [f"{message_id}.1"] * 3
    assert [verify(secret, h.body, h.headers) for h in receiver.hits] == [
        msgspec.json.decode(body)
    ] * 3
    last = receiver.hits[-1]
    assert verify(secret, body.replace(b"SUCCEEDED", b"FAILED"), last.headers) is None
    assert verify(secret, body, last.headers | {"webhook-id": "someone-else.1"}) is None
    assert verify(WHSEC_SECRET if secret == SECRET else SECRET, body, last.headers) is None


async def test_an_answer_after_a_replay_has_a_new_webhook_id(settings: Settings) -> None:
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                message_id, _ = await ended_message(conn, url)
                # replayed by an operator, it ends again under its next attempt
                await ended_message(conn, url, attempt=2, message_id=message_id)

                async def both() -> bool:
                    return len(receiver.accepted) == 2 and await outbox_settled(conn)

                await eventually(both, timeout_s=20)

    assert sorted(h.headers["webhook-id"] for h in receiver.hits) == [
        f"{message_id}.1",
        f"{message_id}.2",
    ]
    assert all(signature_ok(h) for h in receiver.hits)


async def test_an_entry_without_a_webhook_id_is_signed_under_its_message_id(
    settings: Settings,
) -> None:
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn):
                # as a broker that predates `webhook_id` wrote it
                body = b'{"id":"m-old","stage":"SUCCEEDED","attempt":1}'
                fields = ("id", "m-old", "url", url, "body", body, "attempt", 1)
                await conn.call("XADD", conn.keys.outbox, "*", *fields)
                await eventually(lambda: delivered_and_settled(conn, receiver), timeout_s=10)

    (hit,) = receiver.hits
    assert hit.headers["webhook-id"] == "m-old"
    assert signature_ok(hit)


# -- where a delivery may go -----------------------------------------------------------------


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(
    ("hosts", "delivered"),
    [(["localhost"], False), (["localhost", "127.0.0.0/8"], True)],
    ids=["the-name-only", "and-its-network"],
)
async def test_a_name_that_resolves_to_loopback_needs_its_address_allowed_too(
    settings: Settings, hosts: list[str], delivered: bool
) -> None:
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings, callback_hosts=hosts)) as conn:
            async with serving(receiver) as url, running_notifier(conn) as notifier:
                by_name = url.replace("//127.0.0.1:", "//localhost:")
                message_id, _ = await ended_message(conn, by_name)

                async def ended() -> bool:
                    return bool(notifier.handled) and await outbox_settled(conn)

                await eventually(ended, timeout_s=10)
            letters = await dead_letters(conn)
            timeline = await events(conn, message_id)

    if delivered:
        (hit,) = receiver.hits
        assert signature_ok(hit)
        assert notifier.handled == {"delivered": 1}
        assert letters == []
        return
    assert receiver.hits == []
    assert notifier.handled == {"dead-lettered": 1}  # at once: a refusal is not retried
    (letter,) = letters
    assert letter[b"id"].decode() == message_id
    assert letter[b"reason"] == b"callback_undeliverable"
    assert letter[b"url"].decode() == by_name
    assert letter[b"attempts"] == b"0"
    assert letter[b"error"].decode() == (
        f"refused to connect to localhost:{urlsplit(by_name).port}: 127.0.0.1 is a loopback"
        " address and no callback_hosts entry covers it (to allow it, add 127.0.0.1 or"
        " 127.0.0.0/8 to callback_hosts)"
    )
    assert CALLBACK_DELIVERED not in timeline


async def test_a_redirect_is_never_followed(settings: Settings) -> None:
    elsewhere = Receiver()
    with anyio.fail_after(30):
        async with serving(elsewhere) as other_url:
            redirecting = Receiver(answers=[307, 307, 307], location=other_url)
            changes = {"webhook_attempts": 3}
            async with (
                connected(hook_settings(settings, **changes)) as conn,
                serving(redirecting) as url,
                running_notifier(conn),
            ):
                message_id, _ = await ended_message(conn, url)

                async def dead() -> bool:
                    return bool(await dead_letters(conn)) and await outbox_settled(conn)

                await eventually(dead, timeout_s=20)
                (letter,) = await dead_letters(conn)

    assert elsewhere.hits == []  # allowed, and still never reached through a redirect
    assert [h.status for h in redirecting.hits] == [307, 307, 307]
    assert letter[b"id"].decode() == message_id
    assert letter[b"error"] == b"answered 307"
    assert letter[b"attempts"] == b"3"


async def test_a_partitioned_outbox_is_read_whole_and_each_retry_stays_in_its_partition(
    settings: Settings,
) -> None:
    """``ingress_partitions = 3``: deliveries land in three outbox partitions by message id; a
    failed first attempt's retry is written to the partition it came from (checked while it
    waits out its back-off), and every delivery arrives."""
    count = 24
    receiver = Receiver(answers=[500] * count)
    changes = {"ingress_partitions": 3, "webhook_backoff_ms": 5000, "webhook_backoff_max_ms": 8000}
    with anyio.fail_after(60):
        async with connected(hook_settings(settings, **changes)) as conn:
            streams = outboxes(conn.keys)
            async with serving(receiver) as url, running_notifier(conn):
                # ids drawn until each partition has a third of them: by chance alone, one
                # of the three got none of 24 ids about once in 3,000 runs
                ids = [
                    (await ended_message(conn, url, message_id=id_in(conn, streams[i % 3])))[0]
                    for i in range(count)
                ]
                retries: dict[str, str] = {}

                async def all_retrying() -> bool:
                    for stream in streams:
                        for _, flat in await conn.call("XRANGE", stream, "-", "+"):
                            entry = pairs(flat)
                            if entry[b"attempt"] == b"2":
                                retries[entry[b"id"].decode()] = stream
                    return len(retries) == count

                await eventually(all_retrying, timeout_s=20, interval_s=0.05)

                async def settled() -> bool:
                    return len(receiver.accepted) == count and all(
                        [await stream_settled(conn, stream) for stream in streams]
                    )

                await eventually(settled, timeout_s=30)

    assert retries == {i: outbox_for(conn.keys, i) for i in ids}
    assert set(retries.values()) == set(streams) and len(streams) == 3
    delivered = {msgspec.json.decode(h.body)["id"] for h in receiver.accepted}
    assert delivered == set(ids)


# -- outbox entries with any bytes -----------------------------------------------------------

URL_MARK = b"<url>"  # replaced by the live receiver's URL: a wrongly accepted entry would POST
GOOD: dict[bytes, bytes] = {
    b"id": b"m-bad",
    b"webhook_id": b"m-bad.1",
    b"url": URL_MARK,
    b"body": b'{"id":"m-bad","stage":"SUCCEEDED","attempt":1}',
    b"attempt": b"1",
}


def but(**changes: bytes | None) -> dict[bytes, bytes]:
    """The good entry's fields with some changed (``None``: left out)."""
    fields = dict(GOOD)
    for name, value in changes.items():
        if value is None:
            fields.pop(name.encode())
        else:
            fields[name.encode()] = value
    return fields


MALFORMED: dict[str, tuple[dict[bytes, bytes], str]] = {
    "no-id": (but(id=None), "field 'id' is missing"),
    "no-url": (but(url=None), "field 'url' is missing"),
    "no-body": (but(body=None), "field 'body' is missing"),
    "only-other-fields": ({b"x": b"y"}, "field 'id' is missing"),
    "id-not-utf8": (but(id=b"m-\xff\xfe"), "field 'id' is not UTF-8"),
    "url-not-utf8": (but(url=b"http://127.0.0.1/\xff"), "field 'url' is not UTF-8"),
    "body-not-utf8": (but(body=b'{"x":"\xc3"}'), "field 'body' is not UTF-8"),
    "webhook-id-not-utf8": (but(webhook_id=b"\x80"), "field 'webhook_id' is not UTF-8"),
    "webhook-id-splits-headers": (
        but(webhook_id=b"m-bad.1\r\nX-Injected: 1"),
        "field 'webhook_id' must be 1 to 512 visible ASCII characters",
    ),
    "id-with-a-space": (but(id=b"m bad"), "field 'id' must be 1 to 512 visible ASCII"),
    "id-empty-after-all": (but(id=b""), "field 'id' must be 1 to 512 visible ASCII"),
    "attempt-in-words": (but(attempt=b"two"), "field 'attempt' must be a whole number from 1"),
    "attempt-zero": (but(attempt=b"0"), "field 'attempt' must be a whole number from 1"),
    "attempt-negative": (but(attempt=b"-1"), "field 'attempt' must be a whole number from 1"),
    "attempt-huge": (but(attempt=b"9" * 40), "field 'attempt' must be a whole number from 1"),
    "attempt-not-utf8": (but(attempt=b"\xff"), "field 'attempt' must be a whole number"),
    "not-before-in-words": (
        but(not_before_ms=b"soon"),
        "field 'not_before_ms' must be a whole number from 0",
    ),
    "field-name-not-utf8": (
        {**GOOD, b"\xffid": b"m-bad"},
        "field name b'\\xffid' is not UTF-8",
    ),
    # its dead letter names the body's stage: a body nested too deeply to read has none
    "no-url-and-a-body-nested-5000-deep": (
        but(url=None, body=b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        "field 'url' is missing",
    ),
}


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_outbox_entry_is_dead_lettered_and_the_next_delivered(
    settings: Settings, case: str
) -> None:
    fields, says = MALFORMED[case]
    receiver = Receiver()
    with anyio.fail_after(30):
        async with connected(hook_settings(settings)) as conn:
            async with serving(receiver) as url, running_notifier(conn) as notifier:
                flat = [v for pair in fields.items() for v in pair]
                flat = [url.encode() if v == URL_MARK else v for v in flat]
                bad = (await conn.call("XADD", conn.keys.outbox, "*", *flat)).decode()
                message_id, _ = await ended_message(conn, url)

                async def both_ended() -> bool:
                    return len(await dead_letters(conn)) == 1 and await delivered_and_settled(
                        conn, receiver
                    )

                await eventually(both_ended, timeout_s=10)
            (letter,) = await dead_letters(conn)

    (hit,) = receiver.hits  # the good one, and only it
    assert hit.headers["webhook-id"] == f"{message_id}.1"
    assert notifier.handled == {"dead-lettered": 1, "delivered": 1}
    assert letter[b"reason"] == b"callback_undeliverable"
    error = letter[b"error"].decode()
    assert error.startswith(f"malformed outbox entry {bad}: "), error
    assert says in error, error
    assert letter[b"source"].decode() == f"{conn.keys.outbox} {bad}"
    assert letter[b"attempts"] == b"0"
    assert msgspec.json.decode(letter[b"raw"])  # what the entry held, for a person to read


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


async def test_a_holder_that_lost_its_entry_while_stalled_does_not_post_it_too(
    settings: Settings,
) -> None:
    """A holder whose renewals are late (its loop stalled: here, it renews every 10 s) loses
    its held retry to a notifier that claims what is idle 0.3 s. Waking to POST, it went on
    and POSTed beside the new holder: attempt 2 twice. It now renews that entry only if it
    is still its own, right before the POST, and leaves it to the new holder."""
    receiver = Receiver(answers=[500])
    backoff = {"webhook_backoff_ms": 1500, "webhook_backoff_max_ms": 1500}
    with anyio.fail_after(30):
        async with (
            connected(hook_settings(settings, **backoff, claim_idle_s=30.0)) as late,
            connected(hook_settings(settings, **backoff, claim_idle_s=0.3)) as quick,
            serving(receiver) as url,
            running_notifier(late, "late") as holder,
        ):
            await ended_message(late, url)

            async def held() -> bool:
                return len(receiver.hits) == 1 and holder.holding == 1

            await eventually(held)  # attempt 1 failed; the retry waits with its holder
            async with running_notifier(quick, "quick") as thief:

                async def all_settled() -> bool:
                    return bool(receiver.accepted) and await outbox_settled(late)

                await eventually(all_settled, timeout_s=20)
                await eventually(lambda: _none_held(holder, thief))

    assert [h.headers["x-reach-delivery-attempt"] for h in receiver.hits] == ["1", "2"]
    assert thief.handled.get("delivered", 0) == 1 and holder.handled.get("delivered", 0) == 0


async def _none_held(*notifiers: Notifier) -> bool:
    return all(n.holding == 0 for n in notifiers)


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


async def test_a_receiver_s_body_is_never_read(settings: Settings) -> None:
    """The status says all. The poster read the receiver's body whole, inflated: 600 KB of
    gzip was 1.7 GB in the process that runs the dispatcher too. Here a receiver answers
    200 and then sends its body for ever: the delivery is done at the status."""

    async def endless(request: Any) -> StreamingResponse:
        async def forever() -> Any:
            while True:
                yield b"x" * 65536
                await anyio.sleep(0.01)

        return StreamingResponse(forever(), status_code=200)

    app = Starlette(routes=[Route("/hook", endless, methods=["POST"])])
    hooks = hook_settings(settings, webhook_timeout_s=5.0)
    delivery = OutboxEntry(message_id="m-1", webhook_id="w-1", url="", body=b"{}")
    async with serve_app(app) as url, WebhookPoster(hooks) as poster:
        attempt = await poster.attempt(msgspec.structs.replace(delivery, url=url + "hook"))
    # read, the body ran past the deadline: "no answer within 5 s", and a retry
    assert attempt.delivered and attempt.detail == "answered 200"


async def test_deliveries_to_a_receiver_with_a_short_answer_share_a_connection(
    settings: Settings,
) -> None:
    """Closing every answer unread dropped every connection: a TLS handshake a delivery."""
    ports: list[int] = []

    async def short(request: Any) -> JSONResponse:
        ports.append(request.client.port)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/hook", short, methods=["POST"])])
    delivery = OutboxEntry(message_id="m-1", webhook_id="w-1", url="", body=b"{}")
    async with serve_app(app) as url, WebhookPoster(hook_settings(settings)) as poster:
        for _ in range(5):
            attempt = await poster.attempt(msgspec.structs.replace(delivery, url=url + "hook"))
            assert attempt.delivered
    assert len(ports) == 5 and len(set(ports)) == 1
