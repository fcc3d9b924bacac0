"""Credit releases on sharded channels (a Redis 7 cluster), classic ones elsewhere
(broker/notifications.py), against real servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from broker.cluster_map import SlotMap
from broker.cluster_pipeliner import ClusterPipeliner
from broker.config import Settings, build_settings
from broker.connection import Connection, ensure_group, open_connection
from broker.credits import release_command
from broker.keyspace import SIDECAR_GROUP
from broker.notifications import Notifications, credit_shard, sharded
from broker.slots import SLOTS, key_slot
from tests.support.cluster import LocalCluster, start_cluster

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def cluster7(
    tmp_path_factory: pytest.TempPathFactory, redis7_binary: Path
) -> Iterator[LocalCluster]:
    """Three masters of Redis 7 or newer (the suite's own cluster runs the bundled 6.2)."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster7"), redis7_binary)
    yield cluster
    cluster.stop()


@pytest.fixture
async def conn7(cluster7: LocalCluster) -> AsyncIterator[Connection]:
    settings = build_settings([{"redis_url": cluster7.url, "prefix": "n7"}])
    async with open_connection(settings, cluster7.url) as conn:
        yield conn


def instances_on_every_node(cluster: LocalCluster, conn: Connection) -> list[str]:
    """One instance id whose sharded credit channel each master serves."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < len(cluster.masters):
        instance = f"echo-{n}"
        found.setdefault(cluster.node_of(key_slot(credit_shard(conn.keys, instance))), instance)
        n += 1
    return [found[i] for i in range(len(cluster.masters))]


async def release_one(conn: Connection, instance: str) -> None:
    """One credit taken and given back, through release.lua as a sidecar runs it."""
    queue, inflight = conn.keys.queue(instance), conn.keys.inflight(instance)
    await ensure_group(conn, queue, SIDECAR_GROUP)
    entry = (await conn.call("XADD", queue, "*", "m", "x")).decode()
    await conn.call("XREADGROUP", "GROUP", SIDECAR_GROUP, "c", "STREAMS", queue, ">")
    await conn.call("SADD", inflight, "m1:1")
    assert await conn.call(*release_command(conn, instance, SIDECAR_GROUP, [("m1:1", entry)])) == 1


async def heard(notes: Notifications) -> set[str]:
    """Every hint until a quiet half second."""
    got: set[str] = set()
    while (hint := await notes.next(timeout_s=0.5)) is not None:
        got.add(f"{hint[0]}={hint[1].decode()}")
    return got


async def test_a_redis_7_cluster_announces_a_release_on_the_instances_own_channel(
    cluster7: LocalCluster, conn7: Connection
) -> None:
    instance = instances_on_every_node(cluster7, conn7)[1]
    channel = credit_shard(conn7.keys, instance)
    owner = cluster7.client(cluster7.node_of(key_slot(channel)))
    others = [cluster7.client(i) for i in range(3) if i != cluster7.node_of(key_slot(channel))]
    sharded_sub = owner.pubsub()
    sharded_sub.ssubscribe(channel)
    classic_subs = [c.pubsub() for c in others]
    for sub in classic_subs:
        sub.subscribe(conn7.keys.credit_channel)
    for sub in [sharded_sub, *classic_subs]:  # the confirmations
        assert sub.get_message(timeout=5) is not None

    await release_one(conn7, instance)

    assert sharded(conn7)
    message = sharded_sub.get_message(timeout=5)
    assert message is not None and message["data"] == f"{instance} 0".encode()
    # nothing on the classic channel, on any other node
    assert [sub.get_message(timeout=0.5) for sub in classic_subs] == [None, None]


async def test_the_dispatchers_notifications_follow_instances_on_every_node(
    cluster7: LocalCluster, conn7: Connection
) -> None:
    first, second, third = instances_on_every_node(cluster7, conn7)
    notes = Notifications(conn7)
    async with anyio.create_task_group() as tg:
        await tg.start(notes.run)
        notes.follow([first, second])
        expected = {f"{credit_shard(conn7.keys, i)}={i} 0" for i in (first, second)}
        with anyio.fail_after(DEADLINE_S):  # subscribing takes a moment: release until heard
            got: set[str] = set()
            while not expected <= got:
                for instance in (first, second):
                    await release_one(conn7, instance)
                got |= await heard(notes)

        notes.follow([third])  # the others left, a new one came
        with anyio.fail_after(DEADLINE_S):
            got = set()
            while f"{credit_shard(conn7.keys, third)}={third} 0" not in got:
                for instance in (first, third):
                    await release_one(conn7, instance)
                got |= await heard(notes)
        await release_one(conn7, first)
        assert not {g for g in await heard(notes) if first in g}
        # the registry channel stays classic: heard from any node
        await conn7.call("PUBLISH", conn7.keys.registry_channel, "echo-9")
        assert f"{conn7.keys.registry_channel}=echo-9" in await heard(notes)
        tg.cancel_scope.cancel()


def unserve(conn: Connection, instance: str) -> ClusterPipeliner:
    """The connection's slot map, as read mid-failover: no master serves the slot of
    ``instance``'s credit channel (the cluster itself is whole)."""
    route = conn.pipeliner
    assert isinstance(route, ClusterPipeliner)
    owners: list[str | None] = [route.map.url_for(slot) for slot in range(SLOTS)]
    owners[key_slot(credit_shard(conn.keys, instance))] = None
    route.map = SlotMap(owners)
    return route


async def test_a_slot_map_with_a_slot_unserved_is_read_again_not_the_end_of_notifications(
    cluster7: LocalCluster, conn7: Connection
) -> None:
    """A map read mid-failover can name no master for a slot: the subscriptions wait for a
    fresh map (read from the cluster) instead of ending the dispatcher's notifications."""
    instance = instances_on_every_node(cluster7, conn7)[0]
    route = unserve(conn7, instance)
    notes = Notifications(conn7)
    notes.follow([instance])
    async with (
        open_connection(conn7.settings, cluster7.url) as releasing,  # its own, whole map
        anyio.create_task_group() as tg,
    ):
        await tg.start(notes.run)
        with anyio.fail_after(DEADLINE_S):
            got: set[str] = set()
            while f"{credit_shard(conn7.keys, instance)}={instance} 0" not in got:
                await release_one(releasing, instance)
                got |= await heard(notes)
        tg.cancel_scope.cancel()
    assert route.map.url_for(key_slot(credit_shard(conn7.keys, instance))) is not None


async def test_while_a_slot_stays_unserved_every_other_hint_is_heard(
    cluster7: LocalCluster, conn7: Connection
) -> None:
    """The instances whose channels a master serves, and the registry channel, are heard
    while another instance's slot has no master in the map (read again only after a minute
    here: the map stays incomplete for the whole test)."""
    unserved, served, _ = instances_on_every_node(cluster7, conn7)
    route = unserve(conn7, unserved)
    notes = Notifications(conn7, retry_s=60.0)
    notes.follow([unserved, served])
    async with (
        open_connection(conn7.settings, cluster7.url) as releasing,
        anyio.create_task_group() as tg,
    ):
        await tg.start(notes.run)
        expected = {
            f"{credit_shard(conn7.keys, served)}={served} 0",
            f"{conn7.keys.registry_channel}=x",
        }
        with anyio.fail_after(DEADLINE_S):
            got: set[str] = set()
            while not expected <= got:
                await release_one(releasing, served)
                await releasing.call("PUBLISH", conn7.keys.registry_channel, "x")
                got |= await heard(notes)
        tg.cancel_scope.cancel()
    assert route.map.url_for(key_slot(credit_shard(conn7.keys, unserved))) is None


async def test_a_redis_6_2_cluster_and_a_single_server_keep_the_classic_channel(
    local_cluster: LocalCluster, settings: Settings, cluster_settings: Settings
) -> None:
    for s in (settings, cluster_settings):
        async with open_connection(s, s.redis_url) as conn:
            assert not sharded(conn)
            notes = Notifications(conn)
            async with anyio.create_task_group() as tg:
                await tg.start(notes.run)
                with anyio.fail_after(DEADLINE_S):
                    got: set[str] = set()
                    while f"{conn.keys.credit_channel}=echo-1 0" not in got:
                        await release_one(conn, "echo-1")
                        got |= await heard(notes)
                tg.cancel_scope.cancel()
