"""The connection layer on a real three-master Redis Cluster (tests/support/cluster.py)."""

from __future__ import annotations

import logging

import anyio
import pytest

from broker.cluster_map import ORDER_BARRIER
from broker.cluster_pipeliner import ClusterPipeliner
from broker.config import Settings, build_settings
from broker.connection import open_connection
from broker.errors import ConfigError, RedisUnavailable
from broker.slots import key_slot
from tests.support.cluster import LocalCluster, free_cluster_port


def keys_on_every_node(cluster: LocalCluster, prefix: str) -> list[str]:
    """One key served by each master."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < len(cluster.masters):
        key = f"{prefix}:k:{{{n}}}"
        found.setdefault(cluster.node_of(key_slot(key)), key)
        n += 1
    return [found[i] for i in range(len(cluster.masters))]


async def test_any_nodes_url_is_enough_and_cluster_mode_is_said(
    local_cluster: LocalCluster, cluster_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_on_every_node(local_cluster, cluster_settings.prefix)
    caplog.set_level(logging.INFO, logger="agent_reach.connection")
    last_node = f"redis://127.0.0.1:{local_cluster.masters[-1].port}"

    async with open_connection(cluster_settings, last_node) as conn:
        await conn.run_all([("SET", key, f"v{i}") for i, key in enumerate(keys)])
        read = await conn.call_many([("GET", key) for key in keys])
        script = await conn.call("EVAL", "return redis.call('GET', KEYS[1])", 1, keys[1])

    assert conn.cluster and read == [b"v0", b"v1", b"v2"] and script == b"v1"
    assert "is a Redis Cluster node: cluster mode, 3 masters" in caplog.text
    for i, key in enumerate(keys):  # each where the cluster says it lives
        assert local_cluster.client(i).get(key) == f"v{i}".encode()


async def test_a_database_other_than_0_is_refused_with_a_reason(
    local_cluster: LocalCluster,
) -> None:
    settings = build_settings([{"redis_url": local_cluster.url + "/2"}])
    with pytest.raises(ConfigError, match="a cluster has only database 0: drop /2"):
        async with open_connection(settings, local_cluster.url + "/2"):
            pass


async def test_a_stale_map_is_corrected_by_moved(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    keys = keys_on_every_node(local_cluster, cluster_settings.prefix)
    async with open_connection(cluster_settings, local_cluster.url) as conn:
        pipeliner = conn.pipeliner
        first = local_cluster.url
        for slot in range(16384):  # the map now says every slot is on the first master
            pipeliner.map.moved(slot, first)  # type: ignore[union-attr]

        await conn.run_all([("SET", key, "x") for key in keys])  # MOVED, then where it lives
        again = await conn.call_many([("GET", key) for key in keys])

        assert again == [b"x", b"x", b"x"]
        assert pipeliner.map.url_for(key_slot(keys[2])) != first  # type: ignore[union-attr]


async def test_a_reader_alone_that_lost_its_node_reads_the_map_again_before_reading(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    """A map read before a failover sends a stream's slot to a node that is gone. A blocking
    reader with no other traffic beside it (``events --follow``) fails once, then reads the
    map again itself and reads where the stream lives, instead of dialling the dead node
    for ever."""
    stream = f"{cluster_settings.prefix}:lone:{{s}}"
    async with open_connection(cluster_settings, local_cluster.url) as conn:
        await conn.call("XADD", stream, "*", "f", "v")
        route = conn.pipeliner
        assert isinstance(route, ClusterPipeliner)
        route.map.moved(key_slot(stream), f"redis://127.0.0.1:{free_cluster_port()}")
        async with conn.reader() as reader:
            with pytest.raises(RedisUnavailable):
                await reader.read_stream(stream, "0")
            entries = await reader.read_stream(stream, "0")
    assert [fields for _, fields in entries] == [{"f": b"v"}]


async def test_ask_during_a_slot_migration_is_followed(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    """A slot migrating from master 0 to master 1: a key not yet moved is answered by the
    source, one already moved by the target after ASKING."""
    source, target = local_cluster.client(0), local_cluster.client(1)
    key = next(
        k
        for k in (f"{cluster_settings.prefix}:ask:{n}" for n in range(10_000))
        if local_cluster.node_of(key_slot(k)) == 0
    )
    slot = key_slot(key)
    target_id = target.execute_command("CLUSTER MYID").decode()
    source_id = source.execute_command("CLUSTER MYID").decode()
    async with open_connection(cluster_settings, local_cluster.url) as conn:
        target.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        try:
            # not on the source: it answers ASK, and the target takes it after ASKING
            await conn.call("SET", key, "moving")
            assert source.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
            assert target.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 1
            assert await conn.call("GET", key) == b"moving"
        finally:  # the migration completed: the slot is the target's now, on every node
            for n in range(len(local_cluster.masters)):
                local_cluster.client(n).execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)


async def test_a_batch_with_an_order_barrier_answers_in_place(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    first, second, third = keys_on_every_node(local_cluster, cluster_settings.prefix)
    batch = [("SET", first, "1"), ORDER_BARRIER, ("SET", second, "2"), ("GET", first)]
    async with open_connection(cluster_settings, local_cluster.url) as conn:
        replies = await conn.call_many([*batch, ORDER_BARRIER, ("GET", third)])

    assert replies == [b"OK", None, b"OK", b"1", None, None]


async def test_concurrent_first_calls_share_one_pipeliner_per_node(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    keys = [f"{cluster_settings.prefix}:many:{n}" for n in range(300)]
    async with open_connection(cluster_settings, local_cluster.url) as conn:
        async with anyio.create_task_group() as tg:  # all before any node's pipeliner runs
            for key in keys:
                tg.start_soon(conn.call, "SET", key, "1")
        counts = [await conn.call_on(node, "DBSIZE") for node in conn.nodes]

    assert len(conn.pipeliner._nodes) == 3  # type: ignore[union-attr]
    assert all(count > 0 for count in counts)
