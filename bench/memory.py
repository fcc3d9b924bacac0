"""Redis memory per message: while it waits (WAITING), and once finished (kept for its TTL).

One fresh redis-server on loopback. A dispatcher runs with no instance registered, so each of
``--messages`` envelopes (``--payload`` bytes of JSON, a reply stream) is accepted and waits;
then an in-process sidecar (a no-op handler) registers and runs them all to SUCCEEDED; the
replies are read, the reply stream deleted and the acknowledged ingress entries trimmed, so
what is left per message is what a finished message keeps for ``record_ttl_s``.

Prints, for each state, ``used_memory`` grown per message (everything: record, timeline,
waiting-set, due and ingress entries) and the mean ``MEMORY USAGE`` of a sample of records
and timelines, with their encodings. The figures to halve (issue 17, goal 5) are these.

Usage: ``python -m bench.memory [--messages 5000] [--payload 100]``. No threshold: CI never
runs it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec

from adapters.sidecar import Sidecar
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RedisServer
from broker.envelope import Envelope, complete
from broker.records import InstanceCard
from workers.dispatcher import Dispatcher

from .pipeline import noop_agent, wait_replies

CAPABILITY = "bench.noop"
SAMPLE = 200


async def used_memory(conn: Connection) -> int:
    info = (await conn.call("INFO", "memory")).decode()
    return int(next(line for line in info.splitlines() if line.startswith("used_memory:"))[12:])


async def per_key(conn: Connection, keys: list[str]) -> tuple[float, str]:
    """Mean ``MEMORY USAGE`` of ``keys`` and their encodings."""
    sizes = await conn.call_many([("MEMORY", "USAGE", k, "SAMPLES", "0") for k in keys])
    kinds = await conn.call_many([("OBJECT", "ENCODING", k) for k in keys])
    found = sorted({k.decode() for k in kinds if isinstance(k, bytes)})
    return statistics.fmean(int(s) for s in sizes if isinstance(s, int)), "/".join(found)


async def waiting_count(conn: Connection) -> int:
    replies = await conn.call_many(
        [("ZCARD", conn.keys.waiting(CAPABILITY)), ("ZCARD", conn.keys.unmatched(CAPABILITY))]
    )
    return sum(int(r) for r in replies)


async def measure(conn: Connection, messages: int, payload: int) -> dict[str, Any]:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    body = msgspec.Raw(msgspec.json.encode("x" * max(0, payload - 2)))
    envelopes = [
        complete(Envelope(capability=CAPABILITY, payload=body, reply_to=reply_to, timeout_s=3600))
        for _ in range(messages)
    ]
    ids = [e.message_id for e in envelopes]
    out: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        await tg.start(Dispatcher(conn, consumer="bench").run)
        before = await used_memory(conn)
        await client.submit_many(envelopes)
        with anyio.fail_after(120):
            while await waiting_count(conn) < messages:  # noqa: ASYNC110 - polled, with a deadline
                await anyio.sleep(0.05)
        out["waiting"] = (await used_memory(conn) - before) / messages
        sample = ids[:SAMPLE]
        out["waiting record"] = await per_key(conn, [conn.keys.record(i) for i in sample])
        out["waiting timeline"] = await per_key(conn, [conn.keys.timeline(i) for i in sample])
        card = InstanceCard(
            agent_id="noop",
            instance_id="noop-1",
            capabilities=(CAPABILITY,),
            endpoint="python",
            max_inflight=256,
        )
        await tg.start(Sidecar(conn, card, noop_agent()).run)
        arrivals: dict[str, float] = {}
        with anyio.fail_after(300):
            await wait_replies(conn, reply_to, messages, arrivals)
        await conn.call("DEL", reply_to)
        await conn.call("XTRIM", conn.keys.ingress, "MAXLEN", "0")
        out["finished"] = (await used_memory(conn) - before) / messages
        out["finished record"] = await per_key(conn, [conn.keys.record(i) for i in sample])
        out["finished timeline"] = await per_key(conn, [conn.keys.timeline(i) for i in sample])
        tg.cancel_scope.cancel()
    return out


async def main(messages: int, payload: int, listpack_value: int | None) -> None:
    extra = ["--hash-max-ziplist-value", str(listpack_value)] if listpack_value else []
    server = RedisServer.start(Path(tempfile.mkdtemp(prefix="reach-memory-")), extra_args=extra)
    try:
        settings = build_settings([{"redis_url": server.url, "prefix": "bench"}])
        async with open_connection(settings, server.url) as conn:
            found = await measure(conn, messages, payload)
    finally:
        server.stop()
    setting = f"hash-max-ziplist-value {listpack_value}" if listpack_value else "Redis defaults"
    print(f"{messages} messages, {payload}-byte payloads, {setting}; bytes per message:")
    for state in ("waiting", "finished"):
        record, record_kind = found[f"{state} record"]
        timeline, timeline_kind = found[f"{state} timeline"]
        print(
            f"  {state:<9} used_memory {found[state]:8.0f} | record {record:6.0f} ({record_kind})"
            f" | timeline {timeline:5.0f} ({timeline_kind})"
        )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument(
        "--listpack-value",
        type=int,
        default=None,
        metavar="BYTES",
        help="the server's hash-max-ziplist-value (default: Redis's, 64)",
    )
    args = parser.parse_args()
    anyio.run(main, args.messages, args.payload, args.listpack_value)


if __name__ == "__main__":
    cli()
