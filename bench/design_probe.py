"""The design's own limit, measured: the least work per message Agent-Reach's design asks for,
with nothing else, as a system of the anchors harness.

Issue 17 sets throughput at three times the best anchor, "i.e. reaching the design's own
limit", from a probe that moved no-op messages through four Lua calls each. The harness's
tasks are not no-ops: each body makes one pipelined round trip to Redis, in the process that
runs it. This probe is that design with the harness's body, run by the harness itself
(``bench/anchor_apps/designprobe_app.py``; ``python -m bench.harness_cpu --systems
agentreach taskiq designprobe`` runs it interleaved with the anchors, from the
``agentreach`` venv), so that its figure and the anchors' come from the same hour:

* the producer ``XADD``s each envelope (with a fresh message id) to an ingress stream, 100
  at once, as the harness drives every system (Agent-Reach's ``Client.submit`` checks and
  encodes more);
* a dispatcher process reads the ingress 32 entries at a time and, in one round trip per
  batch, runs one script per entry that records the message (its envelope, ACCEPTED and
  ROUTED with their times) and, against a free credit of 100, appends it to the instance's
  stream; what finds none waits in a list, and a credit's release (published) assigns it
  (``CLAIM``); the batch is acknowledged in the same round trip;
* a sidecar process reads its stream 256 entries at a time and, in one round trip, runs one
  script per entry that moves the record to PROCESSING (RECEIVED and PROCESSING, their times,
  fenced on the stage and the attempt) and answers its envelope; each body runs as its own
  task (``common.record_async``, the harness's); outcomes are written in rounds, one script
  each (SUCCEEDED with the result and its time, fenced the same way; the credit returned, the
  entry acknowledged), and one ``PUBLISH`` a round.

Every stage recorded, fenced, against a credit: three scripts a message, as Agent-Reach runs
(the issue's probe had four: record and route apart from the credit). What the design does
beyond this minimum is left out: the timeline list and counters, deadline entries and the
reaper, replies, idempotency, usage, adaptive credits, heartbeats, routing among instances,
rejections and dead letters, trimming. So its figure is a ceiling Agent-Reach stays under,
not one it could reach as it is.

Processes: ``python -m bench.design_probe dispatcher|sidecar REDIS_URL``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import msgspec

from broker.config import build_settings
from broker.connection import Connection, open_connection
from broker.errors import RedisReplyError
from broker.ids import new_message_id
from broker.resp import RespConnection

INGRESS, GROUP = "probe:ingress", "probe"
QUEUE = "probe:queue"  # the one instance's stream
INFLIGHT, WAITING, CHANNEL = "probe:inflight", "probe:waiting", "probe:credit"
RECORD = "probe:rec:"
CREDITS = 100
INGRESS_BATCH, QUEUE_BATCH = 32, 256
KEEP_S = 86400

ACCEPT_ASSIGN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local now = ARGV[3]
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[4]) then
  redis.call('INCR', KEYS[2])
  redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'attempt', '1')
  redis.call('HSET', KEYS[1], 'stage', 'ROUTED', 'attempt', '1', 'envelope', ARGV[2],
    't_accepted', now, 't_routed', now)
  return 1
end
redis.call('RPUSH', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[1], 'stage', 'WAITING', 'attempt', '1', 'envelope', ARGV[2],
  't_accepted', now)
return 0
"""
CLAIM = """
local n = 0
while tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) do
  local id = redis.call('LPOP', KEYS[3])
  if not id then break end
  redis.call('INCR', KEYS[1])
  redis.call('XADD', KEYS[2], '*', 'id', id, 'attempt', '1')
  redis.call('HSET', ARGV[3] .. id, 'stage', 'ROUTED', 't_routed', ARGV[2])
  n = n + 1
end
return n
"""
TAKE = """
local r = redis.call('HMGET', KEYS[1], 'stage', 'attempt', 'envelope')
if r[1] ~= 'ROUTED' or r[2] ~= ARGV[1] then return false end
redis.call('HSET', KEYS[1], 'stage', 'PROCESSING', 't_received', ARGV[2],
  't_processing', ARGV[2])
return r[3]
"""
FINISH = """
local r = redis.call('HMGET', KEYS[1], 'stage', 'attempt')
if r[1] ~= 'PROCESSING' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'stage', 'SUCCEEDED', 't_succeeded', ARGV[2], 'result', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('DECR', KEYS[2])
redis.call('XACK', KEYS[3], ARGV[5], ARGV[4])
return 1
"""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def checked(replies: list[Any]) -> list[Any]:
    """The replies, once none of them is an error (the probe has no use for one)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def loaded(conn: RespConnection, *scripts: str) -> list[bytes]:
    return checked(await conn.execute([("SCRIPT", "LOAD", s) for s in scripts]))


async def group(conn: RespConnection, stream: str) -> None:
    """The probe's consumer group on ``stream``, from its start (entries added before the
    process came up are read too)."""
    (reply,) = await conn.execute([("XGROUP", "CREATE", stream, GROUP, "0", "MKSTREAM")])
    if isinstance(reply, RedisReplyError) and reply.code != "BUSYGROUP":
        raise reply


def entries_of(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """``XREADGROUP``'s reply for one stream as (entry id, fields) pairs."""
    if not reply:
        return []
    [(_, entries)] = reply
    return [(e[0], dict(zip(e[1][::2], e[1][1::2], strict=True))) for e in entries]


async def opened(stack: AsyncExitStack, url: str, count: int) -> list[RespConnection]:
    """``count`` connections, closed when ``stack`` closes."""
    conns = []
    for _ in range(count):
        conns.append(conn := await RespConnection.open(url))
        stack.push_async_callback(conn.close)
    return conns


async def dispatcher(url: str) -> None:
    async with AsyncExitStack() as stack:
        await dispatch(*await opened(stack, url, 4))


async def dispatch(
    reads: RespConnection, writes: RespConnection, claims: RespConnection, listener: RespConnection
) -> None:
    await group(writes, INGRESS)
    accept_assign, claim = await loaded(writes, ACCEPT_ASSIGN, CLAIM)
    released = asyncio.Event()

    async def hear_releases() -> None:
        await listener.execute([("SUBSCRIBE", CHANNEL)])
        while True:
            await listener.read_one()
            released.set()

    async def assign_waiting() -> None:
        while True:
            await released.wait()
            released.clear()
            command = ("EVALSHA", claim, 3, INFLIGHT, QUEUE, WAITING, CREDITS, now_ms(), RECORD)
            checked(await claims.execute([command]))

    async def read_ingress() -> None:
        read = ("XREADGROUP", "GROUP", GROUP, "d", "COUNT", INGRESS_BATCH, "BLOCK", 1000)
        while True:
            (reply,) = checked(await reads.execute([(*read, "STREAMS", INGRESS, ">")]))
            entries = entries_of(reply)
            if not entries:
                continue
            now = now_ms()
            commands: list[tuple[Any, ...]] = []
            for _, fields in entries:
                message_id = fields[b"id"]
                keys = (RECORD.encode() + message_id, INFLIGHT, QUEUE, WAITING)
                args = (message_id, fields[b"envelope"], now, CREDITS)
                commands.append(("EVALSHA", accept_assign, 4, *keys, *args))
            commands.append(("XACK", INGRESS, GROUP, *(entry_id for entry_id, _ in entries)))
            # one parked only while every credit was taken: a release to come assigns it
            checked(await writes.execute(commands))

    await asyncio.gather(hear_releases(), assign_waiting(), read_ingress())


Body = Callable[[dict[str, Any]], Awaitable[Any]]


async def sidecar(url: str, run: Body | None = None) -> None:
    """The sidecar process; ``run``: the task body, by default the harness's."""
    async with AsyncExitStack() as stack:
        running: set[asyncio.Task[None]] = set()
        try:
            await serve(run or harness_body(), running, *await opened(stack, url, 3))
        finally:
            for task in running:
                task.cancel()


def harness_body() -> Body:
    from common import record_async  # type: ignore[import-not-found]  # the harness's folder

    return record_async  # type: ignore[no-any-return]


async def serve(
    run: Body,
    running: set[asyncio.Task[None]],
    reads: RespConnection,
    takes: RespConnection,
    finishes: RespConnection,
) -> None:
    await group(takes, QUEUE)
    take, finish = await loaded(takes, TAKE, FINISH)
    finished: list[tuple[bytes, bytes, bytes]] = []  # record, entry id, result
    ended = asyncio.Event()

    async def body(record: bytes, entry_id: bytes, envelope: bytes) -> None:
        payload = msgspec.json.decode(envelope)["payload"]
        result = msgspec.json.encode(await run(payload))
        finished.append((record, entry_id, result))
        ended.set()

    async def write_outcomes() -> None:
        while True:
            await ended.wait()
            ended.clear()
            batch = finished[:]
            del finished[:]
            now = now_ms()
            keys = (INFLIGHT, QUEUE)
            commands: list[tuple[Any, ...]] = [
                ("EVALSHA", finish, 3, record, *keys, 1, now, result, entry_id, GROUP, KEEP_S)
                for record, entry_id, result in batch
            ]
            commands.append(("PUBLISH", CHANNEL, "1"))
            checked(await finishes.execute(commands))

    async def read_queue() -> None:
        read = ("XREADGROUP", "GROUP", GROUP, "s", "COUNT", QUEUE_BATCH, "BLOCK", 1000)
        while True:
            (reply,) = checked(await reads.execute([(*read, "STREAMS", QUEUE, ">")]))
            entries = entries_of(reply)
            if not entries:
                continue
            now = now_ms()
            records = [RECORD.encode() + fields[b"id"] for _, fields in entries]
            commands = [
                ("EVALSHA", take, 1, record, fields[b"attempt"], now)
                for record, (_, fields) in zip(records, entries, strict=True)
            ]
            envelopes = checked(await takes.execute(commands))
            for record, (entry_id, _), envelope in zip(records, entries, envelopes, strict=True):
                if envelope is not None:  # fenced out: the record moved on
                    task = asyncio.create_task(body(record, entry_id, envelope))
                    running.add(task)
                    task.add_done_callback(running.discard)

    await asyncio.gather(write_outcomes(), read_queue())


ENVELOPE = msgspec.json.Encoder()


class Producer:
    """The harness's producer side: ``XADD`` of an envelope with a fresh id, concurrent calls
    coalesced into one write per turn of the loop (Agent-Reach's own pipeliner)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def enqueue(self, payload: dict[str, Any]) -> None:
        message_id = new_message_id()
        envelope = ENVELOPE.encode(
            {"id": message_id, "capability": "anchor.noop", "payload": payload}
        )
        await self.conn.call("XADD", INGRESS, "*", "id", message_id, "envelope", envelope)


@asynccontextmanager
async def producer(url: str) -> AsyncIterator[Producer]:
    async with open_connection(build_settings([{"redis_url": url}]), url) as conn:
        yield Producer(conn)


def main() -> None:
    role, url = sys.argv[1:3]
    runs = {"dispatcher": dispatcher, "sidecar": sidecar}
    if role not in runs:
        raise SystemExit("usage: python -m bench.design_probe dispatcher|sidecar REDIS_URL")
    try:
        import uvloop

        uvloop.run(runs[role](url))
    except ImportError:
        asyncio.run(runs[role](url))


if __name__ == "__main__":
    main()
