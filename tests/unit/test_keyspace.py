"""Key names: prefixes, hash tags, and single-slot co-location for the Lua scripts."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.keyspace import Keyspace, due_for, due_sets, ingress_for, ingress_streams
from broker.slots import key_slot

PROPERTY = settings(database=None)
ids = st.from_regex(r"[0-9A-Za-z_.:-]{1,64}", fullmatch=True)
prefixes = st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True)


def crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes: the text of the first non-empty ``{...}``, else the key."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot(key: str) -> int:
    return crc16_xmodem(hash_tag(key).encode()) % 16384


def test_crc16_known_vectors() -> None:
    # The check value of CRC-16/XMODEM, and the example of the Redis Cluster spec.
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert slot("foo") == 12182
    assert slot("{user1000}.following") == slot("{user1000}.followers")
    assert hash_tag("foo{}{bar}") == "foo{}{bar}"
    assert hash_tag("foo{{bar}}zap") == "{bar"


def test_default_prefix_and_layout() -> None:
    keys = Keyspace()
    assert keys.prefix == "reach"
    assert keys.ingress == "reach:in"
    assert keys.record("01X") == "reach:m:{01X}"
    assert keys.timeline("01X") == "reach:t:{01X}"
    assert keys.card("a-1") == "reach:a:{a-1}"
    assert keys.queue("a-1") == "reach:q:{a-1}"
    assert keys.inflight("a-1") == "reach:f:{a-1}"
    assert keys.agents == "reach:agents"
    assert keys.waiting("text.echo") == "reach:w:{text.echo}"
    assert keys.waiting_index == "reach:waiting"
    assert keys.dlq == "reach:dlq"
    assert keys.reply_prefix == "reach:reply:"
    assert keys.reply("me") == "reach:reply:me"
    assert keys.credit_channel == "reach:credit"
    assert keys.registry_channel == "reach:registry"


def all_keys(keys: Keyspace, name: str) -> list[str]:
    return [
        keys.ingress,
        keys.record(name),
        keys.timeline(name),
        keys.card(name),
        keys.queue(name),
        keys.inflight(name),
        keys.agents,
        keys.waiting(name),
        keys.waiting_index,
        keys.dlq,
        keys.reply(name),
        keys.credit_channel,
        keys.registry_channel,
    ]


@PROPERTY
@given(prefix=prefixes, name=ids)
def test_every_key_starts_with_the_prefix(prefix: str, name: str) -> None:
    keys = Keyspace(prefix)
    for key in all_keys(keys, name):
        assert key.startswith(prefix + ":"), key
    assert keys.reply(name).startswith(keys.reply_prefix)


@PROPERTY
@given(prefix=prefixes, name=ids)
def test_distinct_kinds_never_collide(prefix: str, name: str) -> None:
    keys = all_keys(Keyspace(prefix), name)
    assert len(set(keys)) == len(keys)


@PROPERTY
@given(prefix=prefixes, message_id=ids)
def test_message_keys_share_the_id_tag(prefix: str, message_id: str) -> None:
    keys = Keyspace(prefix)
    assert hash_tag(keys.record(message_id)) == message_id
    assert hash_tag(keys.timeline(message_id)) == message_id
    assert slot(keys.record(message_id)) == slot(keys.timeline(message_id))


@PROPERTY
@given(prefix=prefixes, instance=ids)
def test_instance_keys_share_the_instance_tag(prefix: str, instance: str) -> None:
    keys = Keyspace(prefix)
    per_instance = [keys.card(instance), keys.queue(instance), keys.inflight(instance)]
    assert {hash_tag(k) for k in per_instance} == {instance}
    assert len({slot(k) for k in per_instance}) == 1


@pytest.mark.parametrize("prefix", ["reach", "t0", "a.b-c_d"])
def test_prefix_does_not_change_the_slot(prefix: str) -> None:
    assert slot(Keyspace(prefix).record("01X")) == slot(Keyspace().record("01X"))
    assert slot(Keyspace(prefix).queue("a-1")) == slot(Keyspace().card("a-1"))


def test_different_prefixes_never_share_keys() -> None:
    assert set(all_keys(Keyspace("a"), "x")).isdisjoint(all_keys(Keyspace("b"), "x"))


def test_ingress_partitions_keep_todays_name_first_and_each_a_slot_of_its_own() -> None:
    keys = Keyspace("reach")

    assert ingress_streams(keys, 1) == ["reach:in"]
    assert ingress_streams(keys, 3) == ["reach:in", "reach:in:{1}", "reach:in:{2}"]
    assert ingress_for(keys, "anything", 1) == "reach:in"
    assert len({key_slot(s) for s in ingress_streams(keys, 8)}) == 8


def test_a_key_always_picks_the_same_partition_and_keys_spread_over_all() -> None:
    keys = Keyspace("reach")
    picks = Counter(ingress_for(keys, f"01KB{n:022d}", 4) for n in range(4000))

    assert ingress_for(keys, "session-7", 4) == ingress_for(keys, "session-7", 4)
    assert set(picks) == set(ingress_streams(keys, 4))
    assert min(picks.values()) > 800  # an even spread: 1000 each, give or take


def test_the_due_set_in_partitions_keeps_its_name_first() -> None:
    one, three = Keyspace("reach"), Keyspace("reach", partitions=3)

    assert due_sets(one) == ["reach:due"] and due_for(one, "m-1") == "reach:due"
    assert due_sets(three) == ["reach:due", "reach:due:{1}", "reach:due:{2}"]
    picks = Counter(due_for(three, f"01KB{n:022d}") for n in range(3000))
    assert set(picks) == set(due_sets(three)) and min(picks.values()) > 800
