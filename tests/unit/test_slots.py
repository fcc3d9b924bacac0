"""Cluster slots and routing, pure: the specification's vectors, every script's keys in one
slot, and each command sent where its keys live."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.cluster_map import (
    ORDER_BARRIER,
    CrossSlot,
    SlotMap,
    block_slot,
    command_slot,
    node_url,
    redirection,
)
from broker.cluster_pipeliner import units_of
from broker.errors import RedisReplyError
from broker.keyspace import Keyspace
from broker.slots import SLOTS, crc16, key_slot, one_slot
from broker.waiting_sets import heard_waiting, park_commands, waiting_hint


def test_the_specifications_vectors() -> None:
    assert crc16(b"123456789") == 0x31C3  # the cluster specification's check value
    assert key_slot("foo") == 12182 and key_slot("bar") == 5061
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == key_slot(b"foo{}{bar}")  # empty tag: all hashed
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")  # the first { to the first }


@given(st.binary(max_size=64))
def test_any_key_has_one_slot_in_range(key: bytes) -> None:
    assert 0 <= key_slot(key) < SLOTS


KEYS = Keyspace("reach")
SCRIPT_KEYS = {
    "the record and an older record's timeline list, read together": [
        KEYS.record("m1"),
        KEYS.timeline("m1"),
    ],
    "child_done (parent record; its outcomes)": [KEYS.record("m1"), KEYS.outcomes("m1")],
    "assign": [KEYS.card("i1"), KEYS.inflight("i1"), KEYS.queue("i1")],
    "release": [KEYS.inflight("i1"), KEYS.queue("i1")],
    "heartbeat, backlog": [KEYS.card("i1"), KEYS.queue("i1")],
    "forget_instance": [
        KEYS.card("i1"),
        KEYS.inflight("i1"),
        KEYS.queue("i1"),
        KEYS.callback_key("i1"),
    ],
    "claim_due, reschedule_due": [KEYS.due],
}


@pytest.mark.parametrize("script", SCRIPT_KEYS)
def test_every_scripts_keys_hash_to_one_slot(script: str) -> None:
    assert one_slot(SCRIPT_KEYS[script])


def test_commands_go_where_their_keys_live() -> None:
    stream = KEYS.queue("i1")

    assert command_slot(("EVALSHA", "abc", 2, KEYS.record("m"), KEYS.timeline("m"), "x")) == (
        key_slot(KEYS.record("m"))
    )
    assert command_slot(("XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "STREAMS", stream, ">")) == (
        key_slot(stream)
    )
    assert command_slot(("XGROUP", "CREATE", stream, "g", "0", "MKSTREAM")) == key_slot(stream)
    assert command_slot(("HGETALL", KEYS.card("i1"))) == key_slot(KEYS.card("i1"))
    assert command_slot(("PING",)) is None and command_slot(("SCRIPT", "LOAD", "x")) is None
    assert command_slot(("SCAN", "17", "MATCH", "reach:*")) is None  # a cursor, not a key
    with pytest.raises(CrossSlot):
        command_slot(("DEL", KEYS.record("a"), KEYS.record("b")))


def test_a_multi_block_is_one_unit_of_one_slot() -> None:
    record = KEYS.record("m")
    batch = [
        ("HGET", KEYS.card("i"), "x"),
        ("MULTI",),
        ("HSET", record, "a", "1"),
        ("EXPIRE", record, 10),
        ("EXEC",),
        ("PING",),
    ]

    assert units_of(batch) == [
        ([0], key_slot(KEYS.card("i"))),
        ([1, 2, 3, 4], key_slot(record)),
        ([5], None),
    ]
    with pytest.raises(CrossSlot):
        block_slot([("MULTI",), ("HSET", record, "a", "1"), ("XADD", KEYS.dlq, "*"), ("EXEC",)])


def test_redirections_and_node_urls_keep_the_seeds_credentials() -> None:
    seed = "rediss://user:secret@10.0.0.1:7000?ssl_cert_reqs=none"
    moved = redirection(RedisReplyError("MOVED 3999 10.0.0.2:7001"), seed)
    ask = redirection(RedisReplyError("ASK 3999 10.0.0.3:7002"), seed)

    assert moved is not None and not moved.ask and moved.slot == 3999
    assert moved.url == "rediss://user:secret@10.0.0.2:7001?ssl_cert_reqs=none"
    assert ask is not None and ask.ask and ask.url.endswith("@10.0.0.3:7002?ssl_cert_reqs=none")
    assert redirection(RedisReplyError("WRONGTYPE nope"), seed) is None
    assert node_url("redis://127.0.0.1:7000", "::1", 7001) == "redis://[::1]:7001"


def test_a_slot_map_from_cluster_slots() -> None:
    reply = [
        [0, 8191, [b"127.0.0.1", 7000, b"id-a"]],
        [8192, 16383, [b"", 7001, b"id-b"], [b"127.0.0.1", 7003, b"id-r"]],
    ]
    slot_map = SlotMap.from_cluster_slots(reply, "redis://127.0.0.1:7000")

    assert slot_map.url_for(0) == "redis://127.0.0.1:7000"
    assert slot_map.url_for(16383) == "redis://127.0.0.1:7001"  # no host: the seed's
    assert slot_map.nodes == ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
    assert slot_map.covered()
    assert not SlotMap.from_cluster_slots(reply[:1], "redis://127.0.0.1:7000").covered()


def test_parking_writes_the_entries_before_the_index_and_the_hint_that_point_at_them() -> None:
    commands = park_commands(
        KEYS, [("text.echo", "m1", 0, 1), ("text.echo", "m2", 0, 2)], hint=True
    )
    at = commands.index(ORDER_BARRIER)

    assert {command_slot(c) for c in commands[:at]} == {key_slot(KEYS.waiting("text.echo"))}
    assert commands[at + 1 :] == [
        ("SADD", KEYS.waiting_index, "text.echo"),
        ("PUBLISH", KEYS.registry_channel, waiting_hint("text.echo")),
    ]
    assert heard_waiting(waiting_hint("text.echo")) == "text.echo"
    assert heard_waiting(b"a-1") is None  # an instance id: its card changed
    assert key_slot(KEYS.waiting_index) != key_slot(KEYS.waiting("text.echo"))
    assert park_commands(KEYS, [], hint=True) == []
    unhinted = park_commands(KEYS, [("text.echo", "m1", 0, 1)], hint=False)
    assert [c[0] for c in unhinted if c is not ORDER_BARRIER] == ["ZADD", "SADD"]
