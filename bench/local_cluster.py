"""A real local Redis Cluster: three masters from the given ``redis-server`` binary,
on free loopback ports, slots assigned with ``CLUSTER ADDSLOTS`` and joined with
``CLUSTER MEET`` (no ``redis-cli --cluster``: the bundled 6.2 server ships without it)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis

from broker.embedded import RedisServer
from broker.slots import SLOTS

NODE_TIMEOUT_MS = 2000  # a master silent this long is failed over (by its replica)


@dataclass
class LocalCluster:
    masters: list[RedisServer]  # as started: after a failover, see :meth:`owners`
    replicas: list[RedisServer] = field(default_factory=list)  # replicas[i] of masters[i]

    @property
    def url(self) -> str:
        """The first master's URL: any node's is enough."""
        return f"redis://127.0.0.1:{self.masters[0].port}"

    @property
    def nodes(self) -> list[RedisServer]:
        """Masters, then replicas, as started: :meth:`client` and :meth:`owners` index this."""
        return [*self.masters, *self.replicas]

    def client(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.nodes[index].port, socket_timeout=5)

    def node_of(self, slot: int) -> int:
        """The index (in :attr:`nodes`) of the master serving ``slot``."""
        return self.owners()[slot]

    def owners(self, asked: int = 0) -> list[int]:
        """Slot -> the index (in :attr:`nodes`) of the master serving it, as node ``asked``
        says now (after a failover: a replica's index)."""
        ports = [server.port for server in self.nodes]
        owners = [-1] * SLOTS
        for start, end, master, *_ in self.client(asked).execute_command("CLUSTER SLOTS"):
            owners[start : end + 1] = [ports.index(int(master[1]))] * (end - start + 1)
        return owners

    def stop(self) -> None:
        for server in [*self.masters, *self.replicas]:
            server.stop()


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too (Redis needs both,
    so the port is at most 55535)."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def start_node(
    data: Path, binary: Path, *, appendfsync: str = "everysec", port: int = 0
) -> RedisServer:
    """One cluster-enabled ``redis-server`` (``port`` 0: a free one); again on its own
    ``port`` and ``data`` it comes back with its ``nodes.conf``: the same node."""
    return RedisServer.start(
        data,
        port=port or free_cluster_port(),
        binary=binary,
        appendfsync=appendfsync,
        extra_args=[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(data / "nodes.conf"),
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--repl-diskless-sync-delay",  # a replica is served at once, not after 5 s
            "0",
        ],
    )


def start_cluster(
    base: Path,
    binary: Path,
    *,
    masters: int = 3,
    replicas: bool = False,
    appendfsync: str = "everysec",
) -> LocalCluster:
    """``masters`` masters sharing the slots; with ``replicas``, one replica of each."""
    servers: list[RedisServer] = []
    try:
        servers += [
            start_node(base / f"node{n}", binary, appendfsync=appendfsync) for n in range(masters)
        ]
        cluster = LocalCluster(list(servers))
        for n in range(masters):
            first, last = n * SLOTS // masters, (n + 1) * SLOTS // masters - 1
            cluster.client(n).execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
        for n in range(1, masters):
            cluster.client(0).execute_command("CLUSTER MEET", "127.0.0.1", servers[n].port)
        _wait_ok(cluster)
        if replicas:
            for n in range(masters):
                replica = start_node(base / f"replica{n}", binary, appendfsync=appendfsync)
                servers.append(replica)
                cluster.replicas.append(replica)
            _replicate(cluster)
        return cluster
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _replicate(cluster: LocalCluster) -> None:
    """Join each replica to the cluster and make it a replica of its master, in sync."""
    pairs = list(zip(cluster.replicas, cluster.masters, strict=True))
    for replica, master in pairs:
        _client(replica).execute_command("CLUSTER MEET", "127.0.0.1", master.port)
    for replica, master in pairs:
        master_id = _client(master).execute_command("CLUSTER MYID")
        _until(partial(_knows, _client(replica), master_id), "the replica knows its master")
        _client(replica).execute_command("CLUSTER REPLICATE", master_id)
    for replica, _ in pairs:
        _until(partial(_in_sync, _client(replica)), "the replica is in sync")
    _wait_ok(cluster)


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def _in_sync(client: redis.Redis) -> bool:
    return bool(client.info("replication").get("master_link_status") == "up")


def _knows(client: redis.Redis, node_id: Any) -> bool:
    wanted = node_id.decode() if isinstance(node_id, bytes) else str(node_id)
    nodes = client.execute_command("CLUSTER NODES")
    text = nodes if isinstance(nodes, str) else str(nodes)
    return wanted in text


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local cluster: not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


def _wait_ok(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Until every node says the cluster is ok and knows every master's slots."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = 0
        for n in range(len(cluster.masters)):
            client = cluster.client(n)
            info = client.execute_command("CLUSTER INFO")  # parsed into a dict
            slots = client.execute_command("CLUSTER SLOTS")
            if info.get("cluster_state") == "ok" and len(slots) == len(cluster.masters):
                ready += 1
        if ready == len(cluster.masters):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the local cluster did not come up")
        time.sleep(0.05)
