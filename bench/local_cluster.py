"""A real local Redis Cluster: three masters from the given ``redis-server`` binary,
on free loopback ports, slots assigned with ``CLUSTER ADDSLOTS`` and joined with
``CLUSTER MEET`` (no ``redis-cli --cluster``: the bundled 6.2 server ships without it)."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from broker.embedded import RedisServer
from broker.slots import SLOTS


@dataclass
class LocalCluster:
    masters: list[RedisServer]

    @property
    def url(self) -> str:
        """The first master's URL: any node's is enough."""
        return f"redis://127.0.0.1:{self.masters[0].port}"

    def client(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.masters[index].port, socket_timeout=5)

    def node_of(self, slot: int) -> int:
        """The index of the master serving ``slot``."""
        return self.owners()[slot]

    def owners(self) -> list[int]:
        """Slot -> the index of the master serving it, as the cluster says now."""
        ports = [server.port for server in self.masters]
        owners = [-1] * SLOTS
        for start, end, master, *_ in self.client(0).execute_command("CLUSTER SLOTS"):
            owners[start : end + 1] = [ports.index(int(master[1]))] * (end - start + 1)
        return owners

    def stop(self) -> None:
        for server in self.masters:
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


def start_cluster(base: Path, binary: Path, *, masters: int = 3) -> LocalCluster:
    servers: list[RedisServer] = []
    try:
        for n in range(masters):
            data = base / f"node{n}"
            servers.append(
                RedisServer.start(
                    data,
                    port=free_cluster_port(),
                    binary=binary,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(data / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ],
                )
            )
        cluster = LocalCluster(servers)
        for n in range(masters):
            first, last = n * SLOTS // masters, (n + 1) * SLOTS // masters - 1
            cluster.client(n).execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
        for n in range(1, masters):
            cluster.client(0).execute_command("CLUSTER MEET", "127.0.0.1", servers[n].port)
        _wait_ok(cluster)
        return cluster
    except BaseException:
        for server in servers:
            server.stop()
        raise


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
