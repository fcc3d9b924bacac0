"""Redis connections: one coalescing pipeliner per process, a start-up check that waits for a
loading server, and dedicated connections for blocking readers.

Every connection is our own :class:`~broker.resp.RespConnection` (hence every one honours the
URL's TLS parameters). Scripts are loaded at start where the user may (``SCRIPT LOAD``);
a process whose user may not (a producer, under ``agent-reach acl``) never needs to: the
pipeliner loads them when Redis answers ``NOSCRIPT`` and reruns those calls. Loading them up
front keeps that rerun — which runs a script after the commands that followed it in its
batch — to the rare case of a Redis that lost its script cache (a restart).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus

from . import timekeeping
from .cluster_map import SlotMap
from .cluster_pipeliner import ClusterPipeliner
from .cluster_setup import detect, preload, without_db
from .config import Settings
from .errors import RedisReplyError, RedisUnavailable, SetUpDropped
from .keyspace import FleetKeys, Keyspace
from .metric_fields import Counting, capped, count_value, counter_keys
from .pipeliner import Pipeliner
from .redaction import url_without_password
from .redis_url import parse_redis_url
from .resp import RespConnection, describe
from .scripts import Script, ScriptName, load_scripts
from .slots import SLOTS, key_slot, slot_tag
from .streams import READ_SILENCE_S, GroupReader

log = logging.getLogger("agent_reach.connection")

# How long a process waits at start-up for a Redis that is loading its data (its AOF after a
# restart: minutes for a large one) before it gives up.
LOADING_WAIT_S = 120.0
_LOADING_POLL_S = 0.1


@dataclass(slots=True)
class Connection:
    """What every store shares: the coalescing pipeliner, scripts and key names."""

    pipeliner: Pipeliner | ClusterPipeliner
    scripts: dict[ScriptName, Script]
    keys: Keyspace
    settings: Settings
    url: str
    _counting: Counting = field(init=False)
    fleet: FleetKeys = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self._counting = Counting(
            self.keys.counters if s.metrics_counters else None,
            s.metrics_max_series,
            per_slot=self.cluster,
        )
        self.fleet = FleetKeys(self.keys.prefix)

    @property
    def cluster(self) -> bool:
        """Whether this is a Redis Cluster (each command sent to its slot's master)."""
        return isinstance(self.pipeliner, ClusterPipeliner)

    @property
    def nodes(self) -> list[str]:
        """The URL of every server holding keys: this one, or every master of a cluster."""
        if isinstance(self.pipeliner, ClusterPipeliner):
            return self.pipeliner.map.nodes
        return [self.url]

    async def call_on(self, node: str, *command: Any) -> Any:
        """One command on one of :attr:`nodes` (``SCAN``, say, which walks one server)."""
        if isinstance(self.pipeliner, ClusterPipeliner):
            return await self.pipeliner.call_on(node, *command)
        return await self.pipeliner.call(*command)

    async def read_counters(self) -> dict[bytes, bytes]:
        """The counters hash (on a cluster: the sum of every slot's), as field -> count."""
        keys = counter_keys(self.keys.counters, self.cluster)
        total: dict[bytes, int] = {}
        for raw in await self.call_many([("HGETALL", key) for key in keys]):
            if not isinstance(raw, list):
                continue
            for i in range(0, len(raw) - 1, 2):
                count = count_value(raw[i + 1])
                if count is not None:
                    total[raw[i]] = total.get(raw[i], 0) + count
        total = capped(total, self.settings.metrics_max_series)
        return {name: str(n).encode() for name, n in total.items()}

    def per_slot(self, key: str, near: str) -> str:
        """``key`` as a script on ``near``'s slot may write it: on a cluster the copy tagged
        with that slot (:func:`every_slot` lists them all for a reader), else ``key``."""
        return f"{key}:{{{slot_tag(key_slot(near))}}}" if self.cluster else key

    def every_slot(self, key: str) -> list[str]:
        """Every copy of a per-slot ``key`` (:meth:`per_slot`)."""
        return [f"{key}:{{{slot_tag(s)}}}" for s in range(SLOTS)] if self.cluster else [key]

    async def call(self, *command: Any) -> Any:
        """One command through the pipeliner (raw RESP reply); failures raise
        :class:`RedisUnavailable`, error replies :class:`RedisReplyError`."""
        return await self.pipeliner.call(*command)

    async def evalsha(self, name: ScriptName, keys: tuple[str, ...], args: Any) -> Any:
        return await self.pipeliner.call("EVALSHA", self.scripts[name].sha, len(keys), *keys, *args)

    async def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Commands that leave together, in order; error replies come back in place."""
        return await self.pipeliner.call_many(commands)

    async def run_all(self, commands: list[tuple[Any, ...]]) -> None:
        """Commands in one round trip; the first error reply is raised."""
        for reply in await self.pipeliner.call_many(commands):
            if isinstance(reply, Exception):
                raise reply

    def counting(self) -> Counting:
        """Where the scripts count (``lua/count.lua``), by this connection's settings."""
        return self._counting

    def sha(self, name: ScriptName) -> str:
        return self.scripts[name].sha

    def script_command(self, name: ScriptName, keys: tuple[str, ...], args: Any) -> tuple[Any, ...]:
        return ("EVALSHA", self.scripts[name].sha, len(keys), *keys, *args)

    @asynccontextmanager
    async def reader(self, *, silence_s: float = READ_SILENCE_S) -> AsyncIterator[GroupReader]:
        """A dedicated connection for one blocking consumer loop; Redis silent ``silence_s``
        past a read's block is taken as lost."""
        route = self.pipeliner if isinstance(self.pipeliner, ClusterPipeliner) else None
        reader = GroupReader(self.url, route, silence_s=silence_s)
        try:
            yield reader
        finally:
            await reader.close()


@asynccontextmanager
async def open_connection(
    settings: Settings, url: str, *, loading_wait_s: float = LOADING_WAIT_S
) -> AsyncIterator[Connection]:
    """Check the server (waiting while it loads its data, see :func:`wait_until_ready`), then
    run the pipeliner for the block's life."""
    scripts = load_scripts()
    slot_map = await wait_until_ready(
        url, loading_wait_s=loading_wait_s, scripts=list(scripts.values())
    )
    pipeliner: Pipeliner | ClusterPipeliner
    if slot_map is None:
        pipeliner = Pipeliner(url, list(scripts.values()), **durability(settings))
    else:
        pipeliner = ClusterPipeliner(
            url,
            list(scripts.values()),
            slot_map,
            sharded_pubsub=slot_map.sharded_pubsub,
            durability=durability(settings),
        )
    # Entered by hand, as Client does: what the block raises (RequestTimeout, say) comes out
    # as it is, not wrapped in an ExceptionGroup; only the pipeliner's own failure is a group.
    tg = anyio.create_task_group()
    await tg.__aenter__()
    try:
        await tg.start(pipeliner.run)
        keys = Keyspace(settings.prefix, settings.ingress_partitions)
        connection = Connection(pipeliner, scripts, keys, settings, url)
        await tg.start(keep_clock_aligned, connection)
        yield connection
    finally:
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)


# Redis's clock is asked this many times in a row, the tightest round trip kept; a process
# that found none within timekeeping.TOLERANCE_MS asks again after these pauses, then every
# timekeeping.REALIGN_S. The first alignment holds up a connection's opening no longer than
# ALIGN_WAIT_S (Redis silent: the connection's own timeouts are longer).
ALIGN_SAMPLES = 3
ALIGN_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)
ALIGN_WAIT_S = 2.0
_told: set[str] = set()  # what keep_clock_aligned said once in this process


async def align_clock(url: str) -> bool | None:
    """Ask the Redis at ``url`` the time and align this process's clock to it
    (:mod:`broker.timekeeping`), on a connection of its own: no batch of the pipeliner's is
    waited behind, and a ``PING`` first, so that opening it (TCP, TLS, AUTH) is not measured;
    of :data:`ALIGN_SAMPLES` answers, the tightest round trip's is used. ``True``: measured
    (the offset kept or changed); ``None``: no round trip was tight enough to tell;
    ``False``: this user may not ask (rules made before ``TIME`` was granted to every
    role), and the process keeps its own clock."""
    resp = await RespConnection.open(url)
    try:
        samples: list[tuple[int, int, int]] = []
        for command in [("PING",)] + [("TIME",)] * ALIGN_SAMPLES:
            sent_ms = timekeeping.local_ms()
            (reply,) = await resp.execute([command])
            answered_ms = timekeeping.local_ms()
            if isinstance(reply, RedisReplyError):
                if reply.permission_refused:
                    return False
                raise reply
            server_ms = timekeeping.server_time_ms(reply)
            if server_ms is not None:
                samples.append((answered_ms - sent_ms, server_ms, sent_ms))
    finally:
        await resp.close()
    if not samples or min(samples)[0] > timekeeping.TOLERANCE_MS:
        return None
    trip_ms, server_ms, sent_ms = min(samples)
    before = timekeeping.offset_ms()
    after = timekeeping.aligned_offset(server_ms, sent_ms, sent_ms + trip_ms, before)
    if after != before:
        timekeeping.align(after)
        if after:
            log.warning(
                "this host's clock runs %d ms %s Redis's (%s): times are written and judged on "
                "Redis's clock",
                abs(after),
                "behind" if after > 0 else "ahead of",
                url_without_password(url),
            )
        else:
            log.info("this host's clock agrees with Redis's again: its own is used")
    return True


async def keep_clock_aligned(conn: Connection, *, task_status: TaskStatus[None]) -> None:
    """Align the clock before the connection is used (for at most :data:`ALIGN_WAIT_S`),
    then every :data:`~broker.timekeeping.REALIGN_S`; sooner (:data:`ALIGN_RETRY_S`) while
    no measurement was tight enough. Whatever goes wrong here is logged, never raised: the
    connection serves on, on the clock it has. A user who may not ask: said once, and the
    process keeps its own clock."""
    retries = iter(ALIGN_RETRY_S)
    started = False
    while True:
        aligned: bool | None = None
        try:
            with anyio.move_on_after(ALIGN_WAIT_S if not started else None):
                aligned = await align_clock(conn.url)
        except (RedisUnavailable, RedisReplyError) as exc:
            log.info("clock not aligned this time: %s", exc)
        except Exception:
            log.exception("clock not aligned this time")
        if aligned is False:
            _say_once(
                "refused",
                "this process's Redis user may not run TIME (rules made before it): its own "
                "clock is used; give it its role's rules again (agent-reach acl)",
            )
            break
        pause_s = timekeeping.REALIGN_S
        if aligned:
            retries = iter(ALIGN_RETRY_S)
        elif (pause_s := next(retries, pause_s)) == timekeeping.REALIGN_S:
            _say_once(
                "loose",
                f"Redis's clock could not be read within a {timekeeping.TOLERANCE_MS} ms round "
                "trip: this host's own clock is used until it can",
            )
        if not started:
            task_status.started()
            started = True
        await anyio.sleep(pause_s)
    if not started:
        task_status.started()


def _say_once(what: str, message: str) -> None:
    if what not in _told:
        _told.add(what)
        log.warning(message)


def durability(settings: Settings) -> dict[str, Any]:
    """The pipeliner's ``replica_acks`` options (:mod:`broker.durability`)."""
    return {
        "replica_acks": settings.replica_acks,
        "replica_ack_timeout_s": settings.replica_ack_timeout_s,
    }


async def wait_until_ready(
    url: str, *, loading_wait_s: float = LOADING_WAIT_S, scripts: Sequence[Script] = ()
) -> SlotMap | None:
    """Connect and ``PING``. A Redis that answers ``LOADING`` is reading its data after a
    start: not ready yet, not an error. It is asked again until it has loaded, for at most
    ``loading_wait_s`` (said once in the log); then :class:`RedisUnavailable`. A server that
    cannot be reached, or refuses ``PING``, is :class:`RedisUnavailable` at once. Then
    ``scripts`` are loaded, unless the user may not (``NOPERM``: loaded on first use).

    A node of a Redis Cluster is recognised here (:func:`broker.cluster_setup.detect`): its
    slot map is returned, and said in the log; ``None`` for a single server."""
    where = url_without_password(url)
    db = parse_redis_url(url).db
    try:
        # SELECT is refused by a cluster node: connect without it, to say so clearly
        conn = await RespConnection.open(without_db(url) if db else url)
    except SetUpDropped as exc:
        assert isinstance(exc.__cause__, OSError)
        reason = _dropped(url, exc.__cause__)
        raise RedisUnavailable(f"cannot connect to redis at {where}: {reason}") from exc
    except RedisUnavailable as exc:
        reason = describe(exc.__cause__) if exc.__cause__ is not None else str(exc)
        raise RedisUnavailable(f"cannot connect to redis at {where}: {reason}") from exc
    try:
        with anyio.move_on_after(loading_wait_s):
            await _ping_until_loaded(conn, url, loading_wait_s)
            slot_map = await detect(conn, url)
            if slot_map is None and db:
                await _select(conn, url, db)
            await preload(conn, url, slot_map, scripts)
            return slot_map
        raise RedisUnavailable(
            f"redis at {where} is still loading its data after {loading_wait_s:g} s"
        )
    finally:
        await conn.close()


async def _ping_until_loaded(conn: RespConnection, url: str, wait_s: float) -> None:
    where = url_without_password(url)
    told = False
    while True:
        try:
            (reply,) = await conn.execute([("PING",)])
        except RedisUnavailable as exc:
            if not isinstance(exc.__cause__, OSError):  # silent, not gone: said as it is
                raise
            # ConnectionError, ssl.SSLError: the server dropped us
            raise RedisUnavailable(
                f"cannot connect to redis at {where}: {_dropped(url, exc.__cause__)}"
            ) from exc.__cause__
        if not (isinstance(reply, RedisUnavailable) and reply.code == "LOADING"):
            break
        if not told:
            log.warning("redis at %s is loading its data; waiting up to %g s", where, wait_s)
            told = True
        await anyio.sleep(_LOADING_POLL_S)
    if isinstance(reply, Exception):
        raise RedisUnavailable(f"redis at {where} refused PING: {reply}") from reply


async def _select(conn: RespConnection, url: str, db: int) -> None:
    (reply,) = await conn.execute([("SELECT", db)])
    if isinstance(reply, Exception):
        raise RedisUnavailable(f"redis at {url_without_password(url)} refused SELECT {db}: {reply}")


def _dropped(url: str, exc: OSError) -> str:
    """Why the server dropped a new connection; over TLS without a client certificate, the
    likely reason (the server checks clients, and says nothing but a reset)."""
    tls = parse_redis_url(url).tls
    if tls is None or tls.certfile is not None or isinstance(exc, ssl.SSLError):
        return describe(exc)
    return (
        f"{describe(exc)}; a server that checks client certificates drops a client without "
        "one: give ssl_certfile and ssl_keyfile"
    )


async def ensure_group(conn: Connection, stream: str, group: str) -> None:
    """Create a consumer group at id 0 (never ``$``: nothing published meanwhile is skipped).

    ``BUSYGROUP`` (the group exists) is the one error expected here, and handled by name."""
    try:
        await conn.call("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
    except RedisReplyError as exc:
        if exc.code != "BUSYGROUP":
            raise RedisUnavailable(f"cannot create group {group} on {stream}: {exc}") from exc
