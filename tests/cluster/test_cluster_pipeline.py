"""5,000 messages through a real three-master Redis Cluster with three ingress partitions."""

from __future__ import annotations

from collections import Counter

import msgspec

from broker.client import Client
from broker.config import Settings
from broker.connection import open_connection
from broker.envelope import Envelope
from broker.keyspace import ingress_for, ingress_streams
from broker.slots import key_slot
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.agents import http_agent
from tests.support.cluster import LocalCluster
from tests.support.harness import collect_replies, running_dispatcher, running_sidecar

MESSAGES = 5000


async def test_five_thousand_messages_each_once_over_three_masters(
    local_cluster: LocalCluster, cluster_settings: Settings
) -> None:
    settings = msgspec.structs.replace(cluster_settings, ingress_partitions=3)
    async with open_connection(settings, local_cluster.url) as conn:
        client = Client(conn)
        reply_to = client.new_reply_stream()
        envelopes = [
            Envelope(
                capability="text.echo",
                payload=msgspec.Raw(msgspec.json.encode({"n": n})),
                reply_to=reply_to,
            )
            for n in range(MESSAGES)
        ]
        async with (
            http_agent("a") as agent_a,
            http_agent("b") as agent_b,
            running_sidecar(conn, "a-1", ("text.echo",), url=agent_a.url, max_inflight=200),
            running_sidecar(conn, "b-1", ("text.echo",), url=agent_b.url, max_inflight=200),
            running_dispatcher(conn, "d1"),
            running_dispatcher(conn, "d2", reaper=False),
        ):
            ids = await client.submit_many(envelopes)
            try:
                results = await collect_replies(conn, reply_to, MESSAGES, timeout_s=200)
            except TimeoutError:  # say where the unanswered ones are, not just that they are
                stages = Counter(map(str, await MessageStore(conn).stages(ids)))
                raise AssertionError(f"not all answered in 200 s; stages: {stages}") from None

    assert set(results) == set(ids)
    assert all(r.stage is Stage.SUCCEEDED for r in results.values())
    calls = agent_a.log.calls + agent_b.log.calls
    assert sum(calls.values()) == MESSAGES and max(calls.values()) == 1  # each exactly once
    owners = local_cluster.owners()
    masters = Counter(owners[key_slot(conn.keys.record(i))] for i in ids)
    assert set(masters) == {0, 1, 2} and min(masters.values()) > MESSAGES // 5, masters
    streams = ingress_streams(conn.keys, 3)
    spread = Counter(ingress_for(conn.keys, i, 3) for i in ids)
    assert set(spread) == set(streams)
