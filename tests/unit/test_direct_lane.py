"""The direct lane's rules and text (broker/direct_lane.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.direct_lane import Lane, lane_text, plain, read_lane
from broker.envelope import Envelope


@given(
    st.from_regex(r"[0-9A-Za-z_.:-]{1,40}", fullmatch=True),
    st.dictionaries(st.text(max_size=20), st.text(max_size=60), max_size=4),
)
def test_a_lane_reads_back_as_written(instance: str, fields: dict[str, str]) -> None:
    lane = Lane(instance, fields, 1 << 20)
    assert read_lane(lane_text(lane)) == lane


@given(st.binary(max_size=200))
def test_any_bytes_are_a_lane_or_none_never_an_error(raw: bytes) -> None:
    found = read_lane(raw)
    assert found is None or isinstance(found, Lane)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"f-1",
        b'\n{"fields": {}, "max_bytes": 1}',
        b"f-1\n",
        b"f-1\n[]",
        b'f-1\n{"fields": {"a": 1}, "max_bytes": 1}',
        b'f-1\n{"fields": {}}',
        b'f-1\n{"fields": {}, "max_bytes": "1"}',
        b'\xff\n{"fields": {}, "max_bytes": 1}',
    ],
)
def test_a_lane_that_says_no_usable_thing_is_none(raw: bytes) -> None:
    assert read_lane(raw) is None


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
