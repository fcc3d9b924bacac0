"""The sidecar: one per agent instance. It registers the instance, heartbeats, consumes the
instance's stream and walks each message through RECEIVED -> PROCESSING -> outcome.

PROCESSING is written before the request leaves for the agent (write-ahead), so a crash
between RECEIVED and PROCESSING is always safe to redeliver, and a crash after PROCESSING is
resolved only where that is safe (:mod:`broker.recovery`): an idempotent agent is called
again with the same idempotency key, any other parks as NEEDS_CONFIRMATION for an operator. A
stream entry whose attempt or instance is no longer the record's current one is dropped,
never executed.

This module only wires the parts together, each a module named for its job:

- :mod:`adapters.intake` — reading the stream, RECEIVED and PROCESSING, own pending entries;
- :mod:`adapters.runner` — one message through the agent, and what its outcome decides;
- :mod:`adapters.finisher` — outcomes recorded, producers told, credits returned;
- :mod:`adapters.lifecycle` — registration, heartbeats, draining;
- :mod:`adapters.callback_desk` — an async agent's callbacks (``http-async`` only);
- :mod:`adapters.holdings` — what the sidecar holds, which they share.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus

from broker.connection import Connection, ensure_group
from broker.keyspace import SIDECAR_GROUP
from broker.records import InstanceCard
from broker.store import MessageStore
from broker.timekeeping import now_ms

from .a2a import A2ATransport
from .a2a_tasks import A2ATasks
from .callback_desk import CallbackDesk
from .finisher import Finisher
from .holdings import Holdings
from .intake import SidecarIntake, read_silence_s
from .lifecycle import Lifecycle
from .runner import Runner
from .transport import Transport
from .vitals import Vitals
from .workpool import WorkPool


class Sidecar:
    def __init__(
        self,
        conn: Connection,
        card: InstanceCard,
        transport: Transport,
        *,
        grace_s: float = 40.0,
        adaptive_credits: bool = True,
        callback_host: str = "127.0.0.1",
        callback_port: int = 0,
        callback_public_url: str | None = None,
    ) -> None:
        self.conn = conn
        self.card = card
        self.transport = transport
        self.instance_id = card.instance_id
        self.stopped = anyio.Event()
        store = MessageStore(conn)
        wants_callbacks = bool(getattr(transport, "wants_callbacks", False))
        # an async agent's latency is its callback's: minutes, not a congestion signal
        adaptive = adaptive_credits and not wants_callbacks
        self.vitals = Vitals(
            conn.settings, credits=card.max_inflight, now_ms=now_ms(), adaptive=adaptive
        )
        holdings = Holdings()
        self.finisher = Finisher(conn, store, card.instance_id, holdings)
        self.desk = (
            CallbackDesk(
                conn,
                store,
                card.instance_id,
                holdings=holdings,
                finisher=self.finisher,
                vitals=self.vitals,
                bind=(callback_host, callback_port, callback_public_url),
                agent_id=card.agent_id,
            )
            if wants_callbacks
            else None
        )
        self.a2a_tasks = (
            A2ATasks(self.desk, transport)
            if self.desk is not None and isinstance(transport, A2ATransport)
            else None
        )
        if self.a2a_tasks is not None and self.desk is not None:
            self.desk.routes += self.a2a_tasks.routes()
        self._wire_work(store, holdings, grace_s)

    def _wire_work(self, store: MessageStore, holdings: Holdings, grace_s: float) -> None:
        """The parts that run the agent's work, read it in, and keep the instance alive."""
        conn, card, transport = self.conn, self.card, self.transport
        self.runner = Runner(
            conn,
            store,
            card,
            transport,
            holdings=holdings,
            finisher=self.finisher,
            vitals=self.vitals,
            desk=self.desk,
            on_health_change=self._health_changed,
        )
        self.intake = SidecarIntake(
            conn,
            store,
            card.instance_id,
            holdings=holdings,
            finisher=self.finisher,
            runner=self.runner,
            desk=self.desk,
        )
        self.lifecycle = Lifecycle(
            conn,
            store,
            card,
            vitals=self.vitals,
            finisher=self.finisher,
            runner=self.runner,
            desk=self.desk,
            grace_s=grace_s,
        )

    @property
    def callback_url(self) -> str:
        """Where an async agent calls back (once running; empty for other agents)."""
        return self.desk.url if self.desk is not None else ""

    def stop(self) -> None:
        """Begin a graceful stop: no new reads, finish in-flight work, then deregister."""
        self.lifecycle.stop()

    def _health_changed(self) -> None:
        self.lifecycle.beat_soon()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # the card first: a janitor that finds the stream finds a fresh card beside it (a
        # stream with no card is an instance gone for good). Work assigned meanwhile waits in
        # the stream, which the group, made at 0, reads whole.
        await self.lifecycle.register()
        started = False
        try:
            await ensure_group(self.conn, self.conn.keys.queue(self.instance_id), SIDECAR_GROUP)
            silence_s = read_silence_s(self.conn.settings)
            async with (
                self.conn.reader(silence_s=silence_s) as reader,
                anyio.create_task_group() as outer,
            ):
                outer.start_soon(self.lifecycle.heartbeat_loop)
                outer.start_soon(self.finisher.run)
                outer.start_soon(self.lifecycle.overdue_loop)
                if self.desk is not None:
                    url = await outer.start(self.desk.serve)
                    assert self.desk.tokens is not None
                    self.transport.bind_callbacks(url, self.desk.tokens)  # type: ignore[attr-defined]
                    outer.start_soon(self.desk.watch)
                if self.a2a_tasks is not None:
                    outer.start_soon(self.a2a_tasks.ask_loop)
                task_status.started()
                started = True
                async with anyio.create_task_group() as work:
                    pool = self.lifecycle.pool = WorkPool(work, self.card.max_inflight)
                    # first what this instance's pending list holds (a restart after a
                    # crash), inside the read loop: a Redis away at start is waited for there
                    self.intake.holdings.recheck_pending = True
                    await self.intake.consume(reader, pool, self.lifecycle.stopping)
                    await self.lifecycle.drain(pool, work)
                await self.lifecycle.settle(self.finisher.finish_now)
                outer.cancel_scope.cancel()
        except BaseException:
            if not started:  # the card is UP and nothing serves it: routing must skip it
                await self.lifecycle.withdraw()
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self.runner.status.aclose()
        await self.lifecycle.leave()
        self.stopped.set()
