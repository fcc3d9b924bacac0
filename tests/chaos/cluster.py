"""The chaos cluster: a redis-server and real broker processes, each of which can be SIGKILLed
and restarted, and a check that every process is alive and working.

A process counts as started when its log shows its ready line (logs are appended across
restarts, so the count of that line must grow). One that exits without being killed is a
failure: the run stops with its log's tail.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from broker.connection import Connection
from broker.embedded import RedisServer, ping
from broker.errors import RedisUnavailable
from broker.keyspace import DISPATCH_GROUP
from broker.record_codec import pairs
from broker.timekeeping import now_ms
from tests.support.cluster import LocalCluster
from tests.support.processes import start, stop

from .agents import ChaosAgent

T = TypeVar("T")

START_TIMEOUT_S = 30.0
RECONNECT_TIMEOUT_S = 30.0
POLL_S = 0.05
AIM_S = 1.0
READY = {"dispatcher": "agent-reach: dispatching from", "reaper": "agent-reach: reaping"}


class ChaosFailure(AssertionError):
    """The run itself went wrong: a process died on its own, or did not come back."""


async def poll(check: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    """Poll ``check`` until it is true; fail with ``what`` after ``timeout_s``."""
    with anyio.move_on_after(timeout_s):
        while not await check():  # noqa: ASYNC110 - polling a condition, with a deadline
            await anyio.sleep(POLL_S)
        return
    raise ChaosFailure(f"not within {timeout_s:g} s: {what}")


async def retrying(call: Callable[[], Awaitable[T]], *, timeout_s: float = 60.0) -> T:
    """A Redis call that rides out the Redis restart window (``RedisUnavailable``)."""
    with anyio.fail_after(timeout_s):
        while True:
            try:
                return await call()
            except RedisUnavailable:
                await anyio.sleep(POLL_S)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@dataclass
class Member:
    """One broker process of the cluster, restartable with the same arguments."""

    name: str
    kind: str  # dispatcher | reaper | sidecar
    log: Path
    args: list[str]
    agent: ChaosAgent | None = None
    process: subprocess.Popen[bytes] | None = None
    kills: int = 0
    instance_id: str = field(init=False)  # a sidecar's: changes when it comes back fresh

    def __post_init__(self) -> None:
        self.instance_id = f"{self.agent.name}-0" if self.agent else ""

    @property
    def consumer(self) -> str:
        """A dispatcher's consumer name (its last argument)."""
        return self.args[-1]

    def argv(self) -> list[str]:
        if self.agent is None:
            return ["-v", *self.args]
        return ["-v", "sidecar", "--instance-id", self.instance_id, *self.args]

    @property
    def ready_line(self) -> str:
        return f"sidecar {self.instance_id} serving" if self.agent else READY[self.kind]

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def logged_since(self, offset: int, line: str) -> bool:
        with self.log.open("rb") as handle:
            handle.seek(offset)
            return line.encode() in handle.read()


def sidecar_args(agent: ChaosAgent, capability: str) -> list[str]:
    args = ["--agent-id", agent.name, "--capability", capability, "--http", agent.url]
    args += ["--status-url", agent.status_url, "--max-inflight", "8", "--grace", "1"]
    return [*args, "--idempotent"] if agent.idempotent else args


@dataclass
class Cluster:
    server: RedisServer | LocalCluster
    appendfsync: str
    env: dict[str, str]
    logs: Path
    members: list[Member] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    redis_restarts: list[dict[str, float]] = field(default_factory=list)
    fresh_ids: int = 0  # sidecars restarted under a fresh instance id

    def add_dispatcher(self, consumer: str) -> None:
        args = ["dispatcher", "--consumer", consumer]
        self.members.append(
            Member(f"dispatcher-{consumer}", "dispatcher", self._log(consumer), args)
        )

    def add_reaper(self, name: str) -> None:
        self.members.append(Member(f"reaper-{name}", "reaper", self._log(name), ["reaper"]))

    def add_sidecar(self, agent: ChaosAgent, capability: str) -> None:
        args = sidecar_args(agent, capability)
        log = self._log(agent.name)
        self.members.append(Member(f"sidecar-{agent.name}", "sidecar", log, args, agent))

    def _log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def dispatchers(self) -> list[Member]:
        return [m for m in self.members if m.kind == "dispatcher"]

    @property
    def sidecars(self) -> list[Member]:
        return [m for m in self.members if m.kind == "sidecar"]

    async def start(self, member: Member) -> None:
        """Start the process and wait until its log says it is serving."""
        offset = member.log_size()
        process = member.process = start(member.argv(), self.env, member.log)

        async def ready() -> bool:
            if process.poll() is not None:
                raise ChaosFailure(
                    f"{member.name} exited with {process.returncode} while starting:\n"
                    + tail(member.log)
                )
            return member.logged_since(offset, member.ready_line)

        await poll(ready, timeout_s=START_TIMEOUT_S, what=f"{member.name} ready")

    async def start_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for member in self.members:
                tg.start_soon(self.start, member)

    def check_alive(self) -> None:
        """Every process is running: none exited without being killed."""
        for member in self.members:
            process = member.process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise ChaosFailure(f"{member.name} exited on its own ({code}):\n{tail(member.log)}")

    async def crash(self, member: Member) -> None:
        """SIGKILL, then restart with the same arguments. A sidecar comes back alternately
        under its instance id and under a fresh one (a new consumer with nothing to reclaim)."""
        self.check_alive()
        process = member.process
        assert process is not None
        if member.agent is not None:
            await self._aim(member.agent)
        process.kill()
        await anyio.to_thread.run_sync(process.wait)
        member.kills += 1
        self.kills[member.kind] += 1
        if member.agent is not None and member.kills % 2 == 0:
            self.fresh_ids += 1
            member.instance_id = f"{member.agent.name}-{member.kills}"
        await self.start(member)

    async def _aim(self, agent: ChaosAgent) -> None:
        """Kill a sidecar while its agent is working on a call, when that happens soon: the
        window between PROCESSING and the outcome is the one that must not run twice."""
        with anyio.move_on_after(AIM_S):
            while not agent.executions.running:  # noqa: ASYNC110 - a condition, with a bound
                await anyio.sleep(0.002)
            self.kills["sidecar, a call in flight"] += 1

    async def crash_redis(self, conn: Connection, downtime_s: float) -> None:
        """SIGKILL redis-server, leave it down ``downtime_s``, restart it from its AOF on the
        same port, and wait until every process works against it again."""
        self.check_alive()
        assert isinstance(self.server, RedisServer), "one server's restart"
        port, data_dir = self.server.port, self.server.data_dir
        killed_at = anyio.current_time()
        self.server.kill()
        await anyio.sleep(downtime_s)  # the outage itself: the schedule, not a synchronisation
        self.server = await anyio.to_thread.run_sync(
            lambda: RedisServer.start(data_dir, port=port, appendfsync=self.appendfsync)
        )
        await poll(
            lambda: anyio.to_thread.run_sync(ping, port),
            timeout_s=RECONNECT_TIMEOUT_S,
            what="redis-server answers PING after its restart",
        )
        up_at, up_ms = anyio.current_time(), now_ms()
        await poll(
            lambda: self.reconnected(conn, up_ms),
            timeout_s=RECONNECT_TIMEOUT_S,
            what="every sidecar heartbeats and every dispatcher reads again after the restart",
        )
        self.check_alive()
        self.redis_restarts.append(
            {"down_s": up_at - killed_at, "reconnected_s": anyio.current_time() - up_at}
        )

    async def reconnected(self, conn: Connection, since_ms: int) -> bool:
        """Each sidecar's card carries a heartbeat, and each dispatcher has read its ingress,
        since ``since_ms`` — or the ingress holds nothing its group has not been given. A read
        shows only where it brings entries: before Redis 7.2 a blocking read that ends empty
        leaves the consumer's idle time as it was, and when the restart comes near the end of
        the production, no entry may be left for a dispatcher to read."""
        try:
            beats = await conn.call_many(
                [("HGET", conn.keys.card(m.instance_id), "hb_ms") for m in self.sidecars]
            )
            consumers = await conn.call("XINFO", "CONSUMERS", conn.keys.ingress, DISPATCH_GROUP)
            stream = pairs(await conn.call("XINFO", "STREAM", conn.keys.ingress))
            groups = await conn.call("XINFO", "GROUPS", conn.keys.ingress)
        except RedisUnavailable:
            return False
        if not all(isinstance(b, bytes) and int(b) >= since_ms for b in beats):
            return False
        given = {pairs(g)[b"name"]: pairs(g)[b"last-delivered-id"] for g in groups}
        if given.get(DISPATCH_GROUP.encode()) == stream[b"last-generated-id"]:
            return True  # nothing to read: no dispatcher can show that it reads
        idle = {c[b"name"].decode(): int(c[b"idle"]) for c in map(pairs, consumers)}
        elapsed = now_ms() - since_ms
        return all(idle.get(m.consumer, elapsed) < elapsed for m in self.dispatchers)

    async def stop_all(self) -> dict[str, Any]:
        """SIGTERM every process (a graceful stop) at once; their exit codes."""
        codes: dict[str, Any] = {}

        async def stop_one(member: Member) -> None:
            if member.process is not None:
                codes[member.name] = await anyio.to_thread.run_sync(stop, member.process)

        async with anyio.create_task_group() as tg:
            for member in self.members:
                tg.start_soon(stop_one, member)
        return codes
