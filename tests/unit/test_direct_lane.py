"""The direct lane's rules and text (broker/direct_lane.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.direct_lane import Lane, lane_text, plain, read_lane
from broker.envelope import Envelope


def a_lane(instance: str = "f-1", **changes: Any) -> Lane:
    terms: dict[str, Any] = {
        "route_from": '["capability:1"]',
        "route_reason": "weighted random among top 1 of 1",
        "max_bytes": 1 << 20,
        "delivery_ms": 30_000,
        "down_after_ms": 15_000,
        "timeline_max": 200,
        "counters_key": "reach:counters",
        "counters_max": 5000,
        "partitions": 1,
    }
    return Lane(instance=instance, **{**terms, **changes})


@given(
    st.from_regex(r"[0-9A-Za-z_.:-]{1,40}", fullmatch=True),
    st.text(max_size=60),
    st.text(max_size=60),
)
def test_a_lane_reads_back_as_written(instance: str, route_from: str, reason: str) -> None:
    lane = a_lane(instance, route_from=route_from, route_reason=reason)
    assert read_lane(lane_text(lane)) == lane


@given(st.binary(max_size=200))
def test_any_bytes_are_a_lane_or_none_never_an_error(raw: bytes) -> None:
    found = read_lane(raw)
    assert found is None or isinstance(found, Lane)


def terms_of(**changes: Any) -> bytes:
    text = lane_text(a_lane())
    return (
        text.split(b"\n", 1)[0]
        + b"\n"
        + msgspec.json.encode({**msgspec.json.decode(text.split(b"\n", 1)[1]), **changes})
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"f-1",
        b"f-1\n",
        b"f-1\n[]",
        b'\xff\n{"route_from": ""}',
        lane_text(a_lane()).split(b"\n")[1],  # no instance line
        terms_of(max_bytes="1"),
        terms_of(delivery_ms=0),
        terms_of(route_reason="x" * 20_000),
        # a field of the record it would write besides the decision's: never from a lane
        terms_of(envelope='{"payload": "rm -rf"}'),
        terms_of(instance="ghost-1"),
    ],
)
def test_a_lane_that_says_no_usable_thing_is_none(raw: bytes) -> None:
    assert read_lane(raw) is None


def test_a_lane_gives_the_record_only_the_decision() -> None:
    assert set(a_lane().fields) == {"route_from", "route_reason"}


@pytest.mark.parametrize(
    "fields",
    [
        {"session_id": "s"},
        {"tags": {"region": "eu"}},
        {"target": "m-1"},
        {"mode": "broadcast"},
        {"budget_per_task": 1.0},
        {"budget": 1.0},
        {"intent": "say hello"},
        {"callback_url": "http://127.0.0.1/h"},
        {"parent": "m-0"},
    ],
)
def test_an_envelope_the_dispatcher_looks_at_more_closely_is_not_plain(
    fields: dict[str, Any],
) -> None:
    assert plain(Envelope(capability="a.b"))
    assert not plain(Envelope(capability="a.b", **fields))


def test_what_the_lane_carries_is_what_any_plain_envelope_would_get() -> None:
    """Priority, tenant, reply stream, timeout and payload change nothing routing decides."""
    envelope = Envelope(
        capability="a.b",
        payload=msgspec.Raw(b'{"x":1}'),
        priority=7,
        tenant="acme",
        reply_to="reach:reply:x",
        timeout_s=3.0,
    )
    assert plain(envelope)
