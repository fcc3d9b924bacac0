"""Broadcast as data: who it goes to, its children and their names, the commands that record a
child's outcome on its parent, and the parent's stage in the lifecycle. No I/O."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from broker.broadcast import (
    MAX_PARENT_ID,
    child_envelope,
    child_id,
    decode_children,
    encode_children,
    fan_out,
    id_problem,
    members,
    no_members_reason,
)
from broker.cluster_map import ORDER_BARRIER
from broker.envelope import Envelope, MessageId, complete
from broker.keyspace import Keyspace
from broker.records import CircuitState, InstanceState, InstanceStats, InstanceView
from broker.results import (
    CHILD_DONE_SHA,
    PARENT_LOOK_MS,
    child_outcome,
    delivery_commands,
)
from broker.routing import RegistryIndex, RouteRequest, RoutingPolicy
from broker.scripts import ScriptName, load_scripts
from broker.stages import TERMINAL, Stage, can_move, sources_for
from tests.unit.test_layering import BROKER, IO_LIBRARIES, imported_modules, top_levels
from tests.unit.test_routing import NOW, inst

KEYS = Keyspace("t")
POLICY = RoutingPolicy(down_after_ms=15_000)


def envelope(**fields: object) -> Envelope:
    raw = msgspec.json.encode(
        {"capability": "cache.flush", "payload": {"x": 1}, "mode": "broadcast", **fields}
    )
    return complete(msgspec.json.decode(raw, type=Envelope), now_s=1.0)


def chosen(pool: list[InstanceView], capability: str = "cache.flush", **request: Any) -> list[str]:
    return members(RouteRequest(capability, **request), RegistryIndex(pool), POLICY, now_ms=NOW)


# -- who a broadcast goes to -------------------------------------------------------------


def test_members_are_the_healthy_instances_in_id_order() -> None:
    pool = [
        inst("c-1", "cache.flush"),
        inst("a-1", "cache.flush", state=InstanceState.DEGRADED),
        inst("b-1", "cache.flush", state=InstanceState.DOWN),
        inst("d-1", "cache.flush", state=InstanceState.DRAINING),
        inst("e-1", "cache.flush", heartbeat_ms=NOW - 15_001),  # silent: DOWN to a router
        inst("f-1", "cache.flush", credits=0),
        inst("g-1", "order.query"),
        inst("h-1", "cache.flush", inflight=10),  # full: its child waits for a credit
    ]
    assert chosen(pool) == ["a-1", "c-1", "h-1"]


def test_members_keep_instances_ejected_for_unicast() -> None:
    """A broadcast has nowhere else to go: cooldown, an open circuit, a back-off do not drop
    an instance (its child waits, or is routed to it by the funnel's panic rule)."""
    ejected = InstanceStats(
        cooldown_until_ms=NOW + 1_000,
        circuit=CircuitState.OPEN,
        circuit_until_ms=NOW + 1_000,
        backoff_until_ms=NOW + 1_000,
    )
    assert chosen([inst("a-1", "cache.flush", stats=ejected), inst("b-1", "cache.flush")]) == [
        "a-1",
        "b-1",
    ]


def test_members_respect_selectors() -> None:
    pool = [
        inst("a-1", "cache.flush", tags={"region": "eu"}),
        inst("a-2", "cache.flush", tags={"region": "us"}),
        inst("b-1", "cache.flush", tags={"region": "eu"}, cost=5.0),
        inst("c-1", "cache.flush", tags={"region": "eu"}, weight=0.0),
    ]
    assert chosen(pool, tags={"region": "eu"}) == ["a-1", "b-1"]
    assert chosen(pool, tags={"region": "eu"}, budget_per_task=1.0) == ["a-1"]
    assert chosen(pool, target="a") == ["a-1", "a-2"]  # an agent id: all its instances
    assert chosen(pool, target="a-2") == ["a-2"]


def test_members_follow_aliases_in_loose_mode() -> None:
    loose = RoutingPolicy(mode="loose", aliases={"cache.clear": "cache.flush"})
    index = RegistryIndex([inst("a-1", "cache.flush")])
    assert members(RouteRequest("cache.clear"), index, loose, now_ms=NOW) == ["a-1"]
    assert members(RouteRequest("cache.clear"), index, POLICY, now_ms=NOW) == []


def test_no_members_at_all() -> None:
    assert chosen([]) == []
    assert no_members_reason("all_candidates_down") == (
        "broadcast: no healthy instance to send it to (all_candidates_down)"
    )


# -- children ------------------------------------------------------------------------------


def test_children_are_numbered_from_one_in_the_given_order() -> None:
    assert fan_out("P", ["a-1", "b-1"]) == [("P.1", "a-1"), ("P.2", "b-1")]
    assert fan_out("P", []) == []
    assert decode_children(encode_children(fan_out("P", ["a-1"]))) == [("P.1", "a-1")]


def test_a_longest_parent_id_still_names_valid_children() -> None:
    longest = "x" * MAX_PARENT_ID
    assert id_problem(longest) is None
    msgspec.convert(child_id(longest, 9_999_999), MessageId)  # 128 characters: still valid
    problem = id_problem(longest + "x")
    assert problem is not None and f"at most {MAX_PARENT_ID}" in problem and "121" in problem
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(child_id(longest + "x", 9_999_999), MessageId)


def test_a_child_is_a_pinned_unicast_without_a_reply_of_its_own() -> None:
    parent = envelope(
        id="P",
        reply_to="t:reply:r",
        callback_url="https://example.com/hook",
        tags={"region": "eu"},
        session_id="s",
        budget_per_task=2.0,
        priority=7,
        timeout_s=12.0,
        max_attempts=5,
        headers={"h": "v"},
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    child = child_envelope(parent, "P.2", "b-1")
    assert child.id == "P.2" and child.parent == "P"
    assert child.mode == "unicast" and child.target == "b-1"
    assert child.reply_to is None and child.callback_url is None
    assert child.tags == {} and child.session_id is None and child.budget_per_task is None
    assert child.idempotency_key == "P.b-1"  # the parent's key (its id by default) + instance
    assert child.payload == parent.payload and child.priority == 7 and child.timeout_s == 12.0
    assert child.max_attempts == 5 and child.headers == {"h": "v"}
    assert child.traceparent == parent.traceparent and child.created_at == parent.created_at
    keyed = child_envelope(envelope(id="Q", idempotency_key="k"), "Q.1", "a-1")
    assert keyed.idempotency_key == "k.a-1"


# -- a child's outcome goes to its parent ---------------------------------------------------


def test_the_child_done_script_is_the_one_the_broker_loads() -> None:
    assert CHILD_DONE_SHA == load_scripts()[ScriptName.CHILD_DONE].sha


@pytest.mark.parametrize("stage", sorted(TERMINAL))
def test_an_ended_child_records_its_outcome_on_its_parent(stage: Stage) -> None:
    child = child_envelope(envelope(id="P"), "P.1", "a-1")
    commands = delivery_commands(KEYS, child, stage, None, "why", attempt=1, now_ms=1_000)
    assert commands[0] == ("ZADD", KEYS.due, "LT", 1_000 + PARENT_LOOK_MS, "P")
    assert commands[1] is ORDER_BARRIER  # another slot: on a cluster the look lands first
    sha, nkeys, *rest = commands[2][1:]
    assert commands[2][0] == "EVALSHA" and sha == CHILD_DONE_SHA and nkeys == 2
    assert rest[:2] == [KEYS.record("P"), KEYS.outcomes("P")]
    assert rest[2:] == [
        "P.1",
        child_outcome("P.1", stage, None, "why"),
        1_000,
        "FANNED_OUT",
        "SUCCEEDED",
        0,  # not counting: the counters' cap is not read
    ]
    assert len(commands) == 3  # a child has no reply_to or webhook of its own


def test_no_outcome_before_a_child_ends_and_none_for_other_messages() -> None:
    child = child_envelope(envelope(id="P"), "P.1", "a-1")
    assert delivery_commands(KEYS, child, Stage.NEEDS_CONFIRMATION, None, "parked", attempt=1) == []
    plain = envelope(id="U", mode="unicast", reply_to="t:reply:r")
    assert [
        c[0] for c in delivery_commands(KEYS, plain, Stage.SUCCEEDED, b"1", None, attempt=1)
    ] == ["XADD"]


def test_an_outcome_starts_with_its_stage_and_carries_the_result_raw() -> None:
    ok = child_outcome("P.1", Stage.SUCCEEDED, b'{"n": 1}', None)
    assert ok.startswith(b'{"stage":"SUCCEEDED"')  # what child_done.lua counts by
    assert msgspec.json.decode(ok) == {"stage": "SUCCEEDED", "id": "P.1", "result": {"n": 1}}
    failed = child_outcome("P.2", Stage.FAILED, None, "400: no")
    assert msgspec.json.decode(failed) == {"stage": "FAILED", "id": "P.2", "error": "400: no"}


# -- the parent's stage --------------------------------------------------------------------


def test_a_parent_fans_out_from_accepted_and_ends_from_fanned_out() -> None:
    assert can_move(Stage.ACCEPTED, Stage.FANNED_OUT)
    assert sources_for(Stage.FANNED_OUT) == {Stage.ACCEPTED}
    assert {s for s in Stage if can_move(Stage.FANNED_OUT, s)} == {
        Stage.SUCCEEDED,
        Stage.FAILED,
        Stage.CANCELLED,
    }
    assert Stage.FANNED_OUT not in TERMINAL


def test_broadcast_is_pure() -> None:
    names = imported_modules(BROKER / "broadcast.py")
    assert not top_levels(names) & IO_LIBRARIES
