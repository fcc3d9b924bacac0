"""Run broker processes inside a test's task group, and wait on conditions with deadlines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import msgspec

from adapters.http import HttpTransport
from adapters.sidecar import Sidecar
from adapters.transport import Transport
from broker.client import Result
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.envelope import Envelope, complete
from broker.ids import new_message_id
from broker.records import InstanceCard
from broker.replies import result_of
from broker.stages import Stage
from broker.store import Acceptance, MessageStore
from broker.timekeeping import now_ms
from broker.wire import parse_reply_entry
from workers.dispatcher import PRUNE_EVERY_S, Dispatcher
from workers.notifier import Notifier
from workers.reaper import Reaper


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[Connection]:
    """A connection for ``settings`` (another user, another prefix, other settings)."""
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


@asynccontextmanager
async def running_dispatcher(
    conn: Connection,
    name: str = "d1",
    *,
    reaper: bool = True,
    prune_every_s: float = PRUNE_EVERY_S,
) -> AsyncIterator[Dispatcher]:
    """A dispatcher, and (as ``agent-reach up`` runs them) a reaper beside it."""
    dispatcher = Dispatcher(conn, consumer=name, prune_every_s=prune_every_s)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        if reaper:
            await tg.start(Reaper(conn).run)
        yield dispatcher
        tg.cancel_scope.cancel()


def card(
    instance_id: str,
    capabilities: tuple[str, ...],
    *,
    max_inflight: int = 16,
    idempotent: bool = False,
    endpoint: str = "",
    status_url: str = "",
    cost: float = 0.0,
    weight: float = 1.0,
) -> InstanceCard:
    return InstanceCard(
        cost=cost,
        weight=weight,
        agent_id=instance_id.split("-")[0],
        instance_id=instance_id,
        capabilities=capabilities,
        endpoint=endpoint,
        max_inflight=max_inflight,
        idempotent=idempotent,
        status_url=status_url,
    )


@asynccontextmanager
async def running_sidecar(
    conn: Connection,
    instance_id: str,
    capabilities: tuple[str, ...],
    *,
    url: str | None = None,
    transport: Transport | None = None,
    max_inflight: int = 16,
    idempotent: bool = False,
    adaptive_credits: bool = True,
    status_url: str = "",
    callback_port: int = 0,
    cost: float = 0.0,
    weight: float = 1.0,
) -> AsyncIterator[Sidecar]:
    if transport is None:
        assert url is not None
        transport = HttpTransport(
            url, timeout_s=conn.settings.sync_call_timeout_s, max_connections=max_inflight
        )
    sidecar = Sidecar(
        conn,
        card(
            instance_id,
            capabilities,
            max_inflight=max_inflight,
            idempotent=idempotent,
            endpoint=url or "python",
            status_url=status_url,
            cost=cost,
            weight=weight,
        ),
        transport,
        grace_s=5.0,
        adaptive_credits=adaptive_credits,
        callback_port=callback_port,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(sidecar.run)
        yield sidecar
        tg.cancel_scope.cancel()
    await transport.aclose()


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 30.0, interval_s: float = 0.02
) -> None:
    """Poll ``check`` until it is true; fail after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while not await check():  # noqa: ASYNC110 - polling a condition, with a deadline
            await anyio.sleep(interval_s)


async def collect_replies(
    conn: Connection, reply_to: str, count: int, *, timeout_s: float = 60.0
) -> dict[str, Result]:
    """Read a reply stream until ``count`` distinct message ids have answered (notices,
    which are no answer, are passed over)."""
    results: dict[str, Result] = {}
    last = "0"
    async with conn.reader() as reader:
        with anyio.fail_after(timeout_s):
            while len(results) < count:
                for entry_id, fields in await reader.read_stream(reply_to, last, block_ms=500):
                    last = entry_id
                    entry = parse_reply_entry(fields)
                    assert not isinstance(entry, str), f"unreadable reply {fields!r}: {entry}"
                    if entry.is_outcome:  # a notice is none (deadline passed, replayed)
                        results[entry.id] = result_of(entry)
    return results


async def dead_letters(conn: Connection) -> list[dict[str, bytes]]:
    """Every entry of the dead-letter stream, oldest first, as field -> value."""
    entries = await conn.call("XRANGE", conn.keys.dlq, "-", "+")
    return [
        {k.decode(): v for k, v in zip(flat[::2], flat[1::2], strict=True)} for _, flat in entries
    ]


async def keys_matching(conn: Connection, pattern: str) -> list[bytes]:
    """``KEYS pattern`` on every server holding keys (each master of a cluster)."""
    return [key for node in conn.nodes for key in await conn.call_on(node, "KEYS", pattern)]


def an_acceptance(
    message_id: str,
    envelope_json: bytes,
    *,
    capability: str = "text.echo",
    next_stage: Stage = Stage.WAITING,
    instance: str = "",
    reason: str = "",
) -> Acceptance:
    """What admission hands ``lua/accept.lua`` for one message, deadline a minute away."""
    return Acceptance(
        message_id=message_id,
        envelope_json=envelope_json,
        capability=capability,
        deadline_ms=now_ms() + 60_000,
        reply_to="",
        priority=0,
        next_stage=next_stage,
        accepted_ms=now_ms(),
        instance=instance,
        reason=reason,
    )


async def routed_to(conn: Connection, instance_id: str) -> str:
    """A message accepted and ROUTED to ``instance_id`` at attempt 1, as admission leaves it
    (its assignment not written: the test writes it)."""
    message_id = new_message_id()
    envelope = complete(
        Envelope(id=message_id, capability="text.echo", payload=msgspec.Raw(b'{"n":1}'))
    )
    acceptance = an_acceptance(
        message_id, msgspec.json.encode(envelope), next_stage=Stage.ROUTED, instance=instance_id
    )
    assert (await MessageStore(conn).accept(acceptance)).created
    return message_id
