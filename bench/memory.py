"""Redis memory per message: while it waits (WAITING), and once finished (kept for its TTL).

One fresh redis-server on loopback. A dispatcher runs with no instance registered, so each of
``--messages`` envelopes (``--payload`` bytes of JSON, a reply stream) is accepted and waits;
then an in-process sidecar (a no-op handler) registers and runs them all to SUCCEEDED; the
replies are read, the reply stream deleted and the acknowledged ingress entries trimmed, so
what is left per message is what a finished message keeps for ``record_ttl_s``.

Prints, for each state, ``used_memory`` grown per message (everything: the record with its
timeline, the waiting-set and due entries) and the mean ``MEMORY USAGE`` of a sample of
records, with their encodings. Both are taken after the acknowledged ingress entries are
trimmed, as every dispatcher does every 10 s (``broker.acks.trim_acknowledged``): what a message
costs while it waits, not the producer's copy on its way in.

The server is started as ``agent-reach`` starts its own (``broker.embedded``: records kept as
listpacks up to 4 KB values); ``--listpack-value 64`` measures with Redis's default.

Usage: ``python -m bench.memory [--messages 5000] [--payload 100] [--listpack-value N]``. No
threshold: CI never runs it.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import anyio
import msgspec

from adapters.sidecar import Sidecar
from broker.acks import trim_acknowledged
from broker.client import Client
from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.embedded import RECORD_LISTPACK_VALUE
from broker.envelope import Envelope, complete
from broker.keyspace import DISPATCH_GROUP, due_sets
from workers.dispatcher import Dispatcher

from .pipeline import noop_agent, noop_card, wait_replies
from .servers import discard, throwaway_server

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
            while (await conn.call("XPENDING", conn.keys.ingress, DISPATCH_GROUP))[0]:  # noqa: ASYNC110
                await anyio.sleep(0.05)  # the last batch is acknowledged after it is parked
        await trim_acknowledged(conn, conn.keys.ingress)
        out["waiting"] = (await used_memory(conn) - before) / messages
        sample = ids[:SAMPLE]
        out["waiting record"] = await per_key(conn, [conn.keys.record(i) for i in sample])
        await tg.start(Sidecar(conn, noop_card(256), noop_agent()).run)
        arrivals: dict[str, float] = {}
        with anyio.fail_after(300):
            await wait_replies(conn, reply_to, messages, arrivals)
        await conn.call("DEL", reply_to)
        await trim_acknowledged(conn, conn.keys.ingress)
        out["finished"] = (await used_memory(conn) - before) / messages
        out["finished record"] = await per_key(conn, [conn.keys.record(i) for i in sample])
        due = await conn.call_many(
            [("MEMORY", "USAGE", key, "SAMPLES", "0") for key in due_sets(conn.keys)]
        )
        out["finished due"] = sum(int(d or 0) for d in due) / messages
        tg.cancel_scope.cancel()
    return out


async def main(messages: int, payload: int, listpack_value: int) -> None:
    extra = ["--hash-max-ziplist-value", str(listpack_value)]
    server = throwaway_server("reach-memory-", extra_args=extra)
    try:
        settings = build_settings([{"redis_url": server.url, "prefix": "bench"}])
        async with open_connection(settings, server.url) as conn:
            found = await measure(conn, messages, payload)
    finally:
        discard(server)
    setting = f"hash-max-ziplist-value {listpack_value}"
    print(f"{messages} messages, {payload}-byte payloads, {setting}; bytes per message:")
    for state in ("waiting", "finished"):
        record, record_kind = found[f"{state} record"]
        print(
            f"  {state:<9} used_memory {found[state]:8.0f} | record with its timeline"
            f" {record:6.0f} ({record_kind})"
        )
    print(
        f"  of the finished figure, {found['finished due']:.0f} bytes are deadline entries"
        " (P:due), which the reaper forgets at its next look, within delivery_timeout_s of"
        " the assignment: for the rest of record_ttl_s a finished message costs"
        f" {found['finished'] - found['finished due']:.0f} bytes"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument(
        "--listpack-value",
        type=int,
        default=RECORD_LISTPACK_VALUE,
        metavar="BYTES",
        help="the server's hash-max-ziplist-value (default: agent-reach's; Redis's is 64)",
    )
    args = parser.parse_args()
    anyio.run(main, args.messages, args.payload, args.listpack_value)


if __name__ == "__main__":
    cli()
