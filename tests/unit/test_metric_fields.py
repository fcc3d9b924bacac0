"""Counter fields and dead-letter kinds: bounded labels whatever the input."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.deadletters import Letter, letter_kind
from broker.metric_fields import COUNTERS, agent_call, field, read_counters, retry


def test_fields_read_back_as_their_labels() -> None:
    raw = {
        retry("text.echo", "late").encode(): b"3",
        agent_call("a", "text.echo", "failed").encode(): b"2",
        field("dead_letters", "rejected").encode(): b"1",
        b"accepted\t~other": b"7",  # past the cap
        b"finished\tonly-one-label": b"5",  # does not read: counted as _other
        b"level\tNEEDS_CONFIRMATION": b"4",  # not a counter
        b"webhooks\tdelivered": b"not a number",
    }
    counted = read_counters(raw)
    assert counted["retries"] == {("text.echo", "late"): 3}
    assert counted["agent_calls"] == {("a", "text.echo", "failed"): 2}
    assert counted["dead_letters"] == {("rejected",): 1}
    assert counted["accepted"] == {("_other",): 7}
    assert counted["finished"] == {("_other", "_other"): 5}
    assert counted["webhooks"] == {}
    assert set(counted) == set(COUNTERS)


@given(st.dictionaries(st.binary(max_size=40), st.binary(max_size=12), max_size=20))
def test_any_hash_reads_without_raising(raw: dict[bytes, bytes]) -> None:
    counted = read_counters(raw)
    for kind, samples in counted.items():
        assert all(len(labels) == len(COUNTERS[kind].labels) for labels in samples)


def test_a_tab_in_a_label_cannot_shift_the_others() -> None:
    assert read_counters({retry("a\tb", "late").encode(): b"1"})["retries"] == {("a b", "late"): 1}


@given(st.text(max_size=80), st.text(max_size=10), st.none() | st.text(max_size=10))
def test_a_letter_kind_is_one_of_few(reason: str, stage: str, source: str | None) -> None:
    kind = letter_kind(Letter(id="x", reason=reason, ts_ms=0, stage=stage, source=source))
    assert kind in {"rejected", "dead", "malformed_entry", "other"} or (
        kind.isascii() and len(kind) <= 40 and reason.startswith(kind)
    )


def test_our_reasons_name_their_kind() -> None:
    def kind(reason: str, **more: str) -> str:
        return letter_kind(Letter(id="x", reason=reason, ts_ms=0, **more))

    assert kind("callback_undeliverable") == "callback_undeliverable"
    assert kind("reply_undeliverable: WRONGTYPE") == "reply_undeliverable"
    assert kind("sidecar_error", source="q 1-0") == "sidecar_error"
    assert kind("Not a JSON object", source="in 1-0") == "malformed_entry"
    assert kind("capability: bad", stage="REJECTED") == "rejected"
    assert kind("gave up", stage="DEAD") == "dead"
