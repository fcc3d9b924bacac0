"""The design's core work per message, measured: what Agent-Reach's design asks of every
message on its saturated path, with nothing else, as a system of the anchors harness.

Issue 17 sets throughput at three times the best anchor, "i.e. reaching the design's own
limit", from a probe that moved no-op messages through four Lua calls each. The harness's
tasks are not no-ops: each body makes one pipelined round trip to Redis, in the process that
runs it. This probe is the design's core with the harness's body, run by the harness itself
(``bench/anchor_apps/designprobe_app.py``; ``python -m bench.harness_cpu --systems
agentreach taskiq designprobe`` runs it interleaved with the anchors, from the
``agentreach`` venv), so that its figure and the anchors' come from the same hour:

* the producer ``XADD``s each envelope (with a fresh message id) to an ingress stream, 100
  at once, as the harness drives every system (Agent-Reach's ``Client.submit`` checks and
  encodes more);
* a dispatcher process reads the ingress 32 entries at a time and, in one round trip per
  batch, runs one script per entry that records the message (its envelope, ACCEPTED and
  ROUTED with their times), writes its deadline entry (where a recovery would first look
  for it) and, against a free credit of 100 and with no work waiting ahead of it, appends it
  to the instance's stream and takes the credit (a member ``id:attempt`` of the in-flight
  set: a copy of an entry releases nothing); otherwise it waits in a set ordered by
  priority, then age, drained in that order as credits are released (``CLAIM``, woken by a
  ``PUBLISH``); the batch is acknowledged in the same round trip;
* a sidecar process reads its stream 256 entries at a time and, in one round trip, runs one
  script per entry that moves the record to PROCESSING (RECEIVED and PROCESSING, their times,
  fenced on the stage and the attempt: a copy, or an attempt gone by, is let go with the
  credit it holds, if any) and answers its envelope; each body runs as its own task
  (``common.record_async``, the harness's); outcomes are written in rounds, one script each
  (SUCCEEDED with the result and its time, or FAILED with the error, fenced the same way; the
  deadline entry removed, the credit returned, the entry acknowledged), and one ``PUBLISH``
  a round.

Every stage recorded, fenced, against a credit, in order: three scripts a message, as
Agent-Reach runs (the issue's probe had four: record and route apart from the credit). What
the design does beyond this core is left out: the timeline (one line a stage, with the
instance, attempt and reason) and counters, the reaper that reads the deadline entries,
replies, idempotency keys, usage, adaptive credits, heartbeats, routing among instances and
the record of its decision, envelope checks, rejections and dead letters, trimming,
tracing. So its figure is a ceiling Agent-Reach stays under, not one it could reach as it
is: what those cost is for each to show.

Processes: ``python -m bench.design_probe dispatcher|sidecar REDIS_URL``; the sidecar's body
is the harness's, so its folder must be on ``PYTHONPATH`` (the harness app sets both).
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
INFLIGHT = "probe:inflight"  # the credits taken: a set of "id:attempt", released once
WAITING = "probe:waiting"  # by score: priority, then age (all tasks here are priority 0)
DUE = "probe:due"  # deadline entries: when a recovery would first look at a message
CHANNEL = "probe:credit"
RECORD = "probe:rec:"
CREDITS = 100
INGRESS_BATCH, QUEUE_BATCH = 32, 256
KEEP_S = 86400
FIRST_LOOK_MS = 30_000

# KEYS: record, in-flight set, stream, waiting set, due set; ARGV: id, envelope, now, credits,
# first look. Work already waiting goes first: a new message takes no credit ahead of it.
ACCEPT_ASSIGN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local now = ARGV[3]
redis.call('ZADD', KEYS[5], now + ARGV[5], ARGV[1])
if redis.call('ZCARD', KEYS[4]) == 0 and redis.call('SCARD', KEYS[2]) < tonumber(ARGV[4]) then
  redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'attempt', '1')
  redis.call('SADD', KEYS[2], ARGV[1] .. ':1')
  redis.call('HSET', KEYS[1], 'stage', 'ROUTED', 'attempt', '1', 'envelope', ARGV[2],
    't_accepted', now, 't_routed', now)
  return 1
end
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('HSET', KEYS[1], 'stage', 'WAITING', 'attempt', '1', 'envelope', ARGV[2],
  't_accepted', now)
return 0
"""
# KEYS: in-flight set, stream, waiting set; ARGV: credits, now, the records' key prefix
CLAIM = """
local n = 0
while redis.call('SCARD', KEYS[1]) < tonumber(ARGV[1]) do
  local head = redis.call('ZPOPMIN', KEYS[3])
  if #head == 0 then break end
  local id = head[1]
  redis.call('XADD', KEYS[2], '*', 'id', id, 'attempt', '1')
  redis.call('SADD', KEYS[1], id .. ':1')
  redis.call('HSET', ARGV[3] .. id, 'stage', 'ROUTED', 't_routed', ARGV[2])
  n = n + 1
end
return n
"""
# KEYS: record, in-flight set, stream; ARGV: id, attempt, now, entry id, group. A record that
# moved on (a copy of an entry, an attempt gone by): the entry is let go, and its credit if
# it holds one.
TAKE = """
local r = redis.call('HMGET', KEYS[1], 'stage', 'attempt', 'envelope')
if r[1] ~= 'ROUTED' or r[2] ~= ARGV[2] then
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[4])
  return redis.call('SREM', KEYS[2], ARGV[1] .. ':' .. ARGV[2]) == 1 and 1 or 0
end
redis.call('HSET', KEYS[1], 'stage', 'PROCESSING', 't_received', ARGV[3],
  't_processing', ARGV[3])
return r[3]
"""
# KEYS: record, in-flight set, stream, due set; ARGV: id, attempt, now, result, entry id,
# group, keep (s), stage (SUCCEEDED or FAILED)
FINISH = """
local r = redis.call('HMGET', KEYS[1], 'stage', 'attempt')
if r[1] ~= 'PROCESSING' or r[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'stage', ARGV[8], 't_finished', ARGV[3], 'result', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1] .. ':' .. ARGV[2])
redis.call('XACK', KEYS[3], ARGV[6], ARGV[5])
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


async def read_new(
    conn: RespConnection, stream: str, consumer: str, count: int
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The next entries the probe's group gives ``consumer`` on ``stream``, once there are."""
    read = ("XREADGROUP", "GROUP", GROUP, consumer, "COUNT", count, "BLOCK", 1000)
    while True:
        (reply,) = checked(await conn.execute([(*read, "STREAMS", stream, ">")]))
        if entries := entries_of(reply):
            return entries


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
            # one at a time on this connection: a claim is never out twice
            checked(await claims.execute([command]))

    async def read_ingress() -> None:
        while True:
            entries = await read_new(reads, INGRESS, "d", INGRESS_BATCH)
            now = now_ms()
            commands: list[tuple[Any, ...]] = []
            for _, fields in entries:
                message_id = fields[b"id"]
                keys = (RECORD.encode() + message_id, INFLIGHT, QUEUE, WAITING, DUE)
                args = (message_id, fields[b"envelope"], now, CREDITS, FIRST_LOOK_MS)
                commands.append(("EVALSHA", accept_assign, 5, *keys, *args))
            commands.append(("XACK", INGRESS, GROUP, *(entry_id for entry_id, _ in entries)))
            checked(await writes.execute(commands))
            # parked behind work waiting, or with every credit taken: a release to come
            # assigns it, or (no credit was taken when it parked) the claim this wakes now
            released.set()

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


Outcome = tuple[bytes, bytes, bytes, str, bytes]  # message id, attempt, entry id, stage, result


async def outcome(run: Body, envelope: bytes) -> tuple[str, bytes]:
    """The body's run: its stage and result (written either way: the credit comes back)."""
    try:
        payload = msgspec.json.decode(envelope)["payload"]
        return "SUCCEEDED", msgspec.json.encode(await run(payload))
    except Exception as exc:
        return "FAILED", repr(exc).encode()


async def serve(
    run: Body,
    running: set[asyncio.Task[None]],
    reads: RespConnection,
    takes: RespConnection,
    finishes: RespConnection,
) -> None:
    await group(takes, QUEUE)
    take, finish = await loaded(takes, TAKE, FINISH)
    finished: list[Outcome] = []
    ended = asyncio.Event()

    async def body(message_id: bytes, attempt: bytes, entry_id: bytes, envelope: bytes) -> None:
        finished.append((message_id, attempt, entry_id, *await outcome(run, envelope)))
        ended.set()

    async def write_outcomes() -> None:
        while True:
            await ended.wait()
            ended.clear()
            batch = finished[:]
            del finished[:]
            now = now_ms()
            commands: list[tuple[Any, ...]] = [
                (
                    *("EVALSHA", finish, 4, RECORD.encode() + message_id, INFLIGHT, QUEUE, DUE),
                    *(message_id, attempt, now, result, entry_id, GROUP, KEEP_S, stage),
                )
                for message_id, attempt, entry_id, stage, result in batch
            ]
            commands.append(("PUBLISH", CHANNEL, "1"))
            checked(await finishes.execute(commands))

    async def read_queue() -> None:
        while True:
            entries = await read_new(reads, QUEUE, "s", QUEUE_BATCH)
            now = now_ms()
            commands: list[tuple[Any, ...]] = [
                (
                    *("EVALSHA", take, 3, RECORD.encode() + f[b"id"], INFLIGHT, QUEUE),
                    *(f[b"id"], f[b"attempt"], now, entry_id, GROUP),
                )
                for entry_id, f in entries
            ]
            answers = checked(await takes.execute(commands))
            for (entry_id, f), answer in zip(entries, answers, strict=True):
                if isinstance(answer, bytes):  # its envelope: the record is PROCESSING
                    task = asyncio.create_task(body(f[b"id"], f[b"attempt"], entry_id, answer))
                    running.add(task)
                    task.add_done_callback(running.discard)
            if 1 in answers:  # an entry let go with its credit: waiting work may take it
                await takes.execute([("PUBLISH", CHANNEL, "1")])

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
    runs = {"dispatcher": dispatcher, "sidecar": sidecar}
    if len(sys.argv) != 3 or sys.argv[1] not in runs:
        raise SystemExit("usage: python -m bench.design_probe dispatcher|sidecar REDIS_URL")
    role, url = sys.argv[1:]
    try:
        import uvloop
    except ImportError:
        asyncio.run(runs[role](url))
    else:  # only the run: an ImportError inside it is not taken for a missing uvloop
        uvloop.run(runs[role](url))


if __name__ == "__main__":
    main()
