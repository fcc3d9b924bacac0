"""Whatever an attacker who can ``XADD`` writes to the ingress stream, a running
``agent-reach up`` answers it precisely — a REJECTED record with the reason and a dead letter
with the bytes — and keeps serving: after the whole battery a normal message succeeds, served
by the very same process."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from broker.config import Settings, build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.harness import collect_replies, dead_letters, eventually, running_sidecar
from tests.support.processes import process_env, start, stop

GOOD = msgspec.json.encode({"capability": "text.echo", "payload": {"x": 1}})
DEEP = b'{"capability": "text.echo", "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def envelope(**fields: object) -> bytes:
    return msgspec.json.encode({"capability": "text.echo", **fields})


# (case, the entry's fields as a flat list, a phrase the reason must hold)
BATTERY: list[tuple[str, list[bytes], str]] = [
    ("field name not UTF-8", [b"\xff\xfe", b"x"], "no `envelope` field (its fields: '\\xff\\xfe')"),
    ("extra field not UTF-8", [b"envelope", GOOD, b"\xc3(", b"1"], "fields besides `envelope`"),
    ("envelope field twice", [b"envelope", GOOD, b"envelope", GOOD], "`envelope` field 2 times"),
    ("no envelope field", [b"payload", GOOD], "no `envelope` field"),
    ("envelope not UTF-8", [b"envelope", b"\xff\xfe\xfd"], "invalid JSON"),
    ("empty envelope", [b"envelope", b""], "invalid JSON"),
    ("JSON array", [b"envelope", b"[1, 2]"], "Expected `object`"),
    ("JSON string", [b"envelope", b'"text"'], "Expected `object`"),
    ("JSON null", [b"envelope", b"null"], "Expected `object`"),
    ("nested 100,000 deep", [b"envelope", DEEP], "levels deep; at most 64"),
    ("two megabytes", [b"envelope", envelope(payload="x" * 2_000_000)], "over the"),
    ("unknown field", [b"envelope", envelope(evil=1)], "unknown field `evil`"),
    ("NUL in capability", [b"envelope", b'{"capability": "text.e\\u0000cho"}'], "capability"),
    ("priority out of range", [b"envelope", envelope(priority=10**40)], "priority"),
    ("header with CRLF", [b"envelope", envelope(headers={"X-A": "1\r\nX-B: 2"})], "control"),
    ("non-ASCII header", [b"envelope", envelope(headers={"X-A": "café"})], "non-ASCII"),
    ("header Host", [b"envelope", envelope(headers={"Host": "evil"})], "'Host' may not be set"),
    (
        "spoofed callback URL",
        [b"envelope", envelope(headers={"x-reach-callback-url": "http://evil/"})],
        "X-Reach-* headers are set by the broker",
    ),
    (
        "Transfer-Encoding",
        [b"envelope", envelope(headers={"Transfer-Encoding": "chunked"})],
        "may not be set",
    ),
    ("bad traceparent", [b"envelope", envelope(traceparent="00-xyz")], "traceparent"),
    ("idempotency key newline", [b"envelope", envelope(idempotency_key="a\nb")], "idempotency"),
    ("idempotency key 10 KB", [b"envelope", envelope(idempotency_key="k" * 10_000)], "idempot"),
    ("id with braces", [b"envelope", envelope(id="a{b}")], "`$.id`"),
    ("reply_to elsewhere", [b"envelope", envelope(reply_to="reach:in")], "must start with"),
    ("parent set", [b"envelope", envelope(parent="p")], "`parent` is set by the broker only"),
    ("target with spaces", [b"envelope", envelope(target="a b")], "`$.target`"),
]

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def module_settings(redis_server: RedisServer) -> Settings:
    return build_settings(
        [
            {
                "redis_url": redis_server.url,
                "prefix": f"hostile{next(_prefixes)}",
                "heartbeat_s": 0.5,
                "sweep_interval_s": 0.2,
                "dlq_entry_max_bytes": 4096,
            }
        ]
    )


@pytest.fixture(scope="module")
def up(
    module_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """One `agent-reach up` process for the whole battery."""
    log = tmp_path_factory.mktemp("hostile") / "up.log"
    env = process_env(module_settings, AGENT_REACH_DLQ_ENTRY_MAX_BYTES="4096")
    process: subprocess.Popen[bytes] = start(["up"], env, log)
    yield process
    stop(process)
    assert "Traceback" not in Path(log).read_text(errors="replace")


@pytest.fixture
def settings(module_settings: Settings) -> Settings:
    return module_settings


@pytest.fixture
async def conn(module_settings: Settings) -> AsyncIterator[Connection]:
    assert module_settings.redis_url is not None
    async with open_connection(module_settings, module_settings.redis_url) as connection:
        yield connection


async def _pending(conn: Connection) -> int:
    groups = await conn.call("XINFO", "GROUPS", conn.keys.ingress)
    return int(dict(zip(groups[0][::2], groups[0][1::2], strict=True))[b"pending"])


@pytest.mark.anyio  # parametrized: the marker must be there before collection ends
@pytest.mark.parametrize(("case", "fields", "phrase"), BATTERY, ids=[b[0] for b in BATTERY])
async def test_a_malformed_entry_ends_rejected_with_its_reason_and_bytes(
    up: subprocess.Popen[bytes], conn: Connection, case: str, fields: list[bytes], phrase: str
) -> None:
    entry_id = (await conn.call("XADD", conn.keys.ingress, "*", *fields)).decode()
    source = f"{conn.keys.ingress} {entry_id}".encode()

    async def lettered() -> bool:
        return any(letter.get("source") == source for letter in await dead_letters(conn))

    await eventually(lettered, timeout_s=20)
    (letter,) = [e for e in await dead_letters(conn) if e.get("source") == source]
    assert letter["stage"] == b"REJECTED"
    assert phrase in letter["reason"].decode(), letter["reason"]
    assert len(letter["raw"]) <= 4096  # capped; the size it had is kept when it was cut
    if b"raw_size" in letter:
        assert int(letter["raw_size"]) > 4096
    record = await MessageStore(conn).get_record(letter["id"].decode())
    assert record is not None and record.stage is Stage.REJECTED
    assert phrase in (record.error or "")
    assert len(record.envelope) <= 4096
    await eventually(lambda: _none_pending(conn), timeout_s=10)


async def _none_pending(conn: Connection) -> bool:
    return await _pending(conn) == 0


async def test_after_the_battery_the_same_process_serves_a_normal_message(
    up: subprocess.Popen[bytes], conn: Connection
) -> None:
    pid = up.pid
    reply_to = conn.keys.reply("after-battery")
    async with (
        http_agent("a") as agent,
        running_sidecar(conn, "a-1", ("text.echo",), url=agent.url),
    ):
        await conn.call(
            "XADD", conn.keys.ingress, "*", "envelope", envelope(reply_to=reply_to, payload=7)
        )
        results = await collect_replies(conn, reply_to, 1)
    (result,) = results.values()
    assert result.stage is Stage.SUCCEEDED and result.result == {"agent": "a", "echo": 7}
    assert up.poll() is None and up.pid == pid  # the process that took the whole battery
