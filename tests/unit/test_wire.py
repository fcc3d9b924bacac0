"""The records others read (``broker/wire.py``, ``broker/deadletters.py``): what each writer
puts on the wire reads back as it was, field names as they have always been, and whatever bytes
anyone else wrote read as a record or a reason — never an exception."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from broker.deadletters import Letter, letter_fields, parse_letter
from broker.record_codec import timeline_entry
from broker.records import TimelineEntry
from broker.replies import answer_in
from broker.stages import Stage
from broker.streams import field_name
from broker.wire import (
    OutboxEntry,
    ReplyEntry,
    outbox_fields,
    parse_outbox_entry,
    parse_reply_entry,
    parse_timeline_item,
    reply_fields,
    route_from_json,
    route_steps,
    timeline_item_json,
)


def stored(flat: list[str | bytes | int]) -> dict[str, bytes]:
    """Field/value pairs as a stream entry gives them back: names as text, values as bytes."""

    def raw(value: str | bytes | int) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    return {field_name(raw(flat[i])): raw(flat[i + 1]) for i in range(0, len(flat), 2)}


def names(flat: list[str | bytes | int]) -> list[str | bytes | int]:
    return flat[::2]


# anything a stream entry may hold
any_names = st.one_of(
    st.sampled_from(
        [
            "id",
            "stage",
            "attempt",
            "result",
            "error",
            "notice",
            "webhook_id",
            "url",
            "body",
            "not_before_ms",
            "last_error",
        ]
    ),
    st.binary(max_size=8).map(field_name),
)
any_values = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(
        [
            b"",
            b"0",
            b"-1",
            b"1",
            b"9" * 30,
            b" 2",
            b"1_0",
            b"\xd9\xa3",
            b"SUCCEEDED",
            b"null",
            b"[" * 3000,
            b"[" * 3000 + b"]" * 3000,
            b'{"a":1}',
            b"a\r\nb",
        ]
    ),
)
any_fields = st.dictionaries(any_names, any_values, max_size=10)

header_safe = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40
)
utf8_text = st.text(max_size=40)  # no lone surrogates: every one encodes as UTF-8
counts = st.integers(min_value=0, max_value=10**15 - 1)
stages = st.sampled_from(list(Stage))


# -- outbox ----------------------------------------------------------------------------------


def test_a_first_attempt_is_written_with_the_fields_it_always_had() -> None:
    entry = OutboxEntry(message_id="m-1", webhook_id="m-1.1", url="http://h/x", body=b"{}")

    assert names(outbox_fields(entry)) == ["id", "webhook_id", "url", "body", "attempt"]
    assert stored(outbox_fields(entry))["attempt"] == b"1"


def test_a_retry_says_when_and_why() -> None:
    entry = OutboxEntry(
        message_id="m-1",
        webhook_id="m-1.1",
        url="http://h/x",
        body=b"{}",
        attempt=2,
        not_before_ms=1_700_000_000_000,
        last_error="answered 500",
    )

    assert names(outbox_fields(entry))[-2:] == ["not_before_ms", "last_error"]
    assert parse_outbox_entry(stored(outbox_fields(entry))) == entry


@given(
    message_id=header_safe,
    webhook_id=header_safe,
    url=utf8_text,
    body=utf8_text.map(str.encode),
    attempt=counts.filter(bool),
    not_before_ms=counts,
    last_error=st.text(max_size=40),
)
def test_every_outbox_entry_reads_back_as_written(
    message_id: str,
    webhook_id: str,
    url: str,
    body: bytes,
    attempt: int,
    not_before_ms: int,
    last_error: str,
) -> None:
    entry = OutboxEntry(
        message_id=message_id,
        webhook_id=webhook_id,
        url=url,
        body=body,
        attempt=attempt,
        not_before_ms=not_before_ms,
        last_error=last_error,
    )

    assert parse_outbox_entry(stored(outbox_fields(entry))) == entry


@given(fields=any_fields)
def test_any_outbox_entry_is_a_delivery_or_a_reason(fields: dict[str, bytes]) -> None:
    parsed = parse_outbox_entry(fields)

    if isinstance(parsed, str):
        assert parsed
        return
    assert parsed.attempt >= 1 and parsed.not_before_ms >= 0
    assert parsed.message_id.isascii() and parsed.message_id.isprintable()
    parsed.body.decode()  # a receiver's verification decodes it


# -- reply streams ---------------------------------------------------------------------------


def test_an_outcome_is_written_with_the_fields_it_always_had() -> None:
    done = ReplyEntry(id="m-1", stage=Stage.SUCCEEDED, attempt=1, result=b'{"x":1}')
    failed = ReplyEntry(id="m-2", stage=Stage.FAILED, attempt=2, error="answered 500")
    bare = ReplyEntry(id="m-3", stage=Stage.REJECTED)

    assert names(reply_fields(done)) == ["id", "stage", "attempt", "result"]
    assert names(reply_fields(failed)) == ["id", "stage", "attempt", "error"]
    assert stored(reply_fields(bare)) == {
        "id": b"m-3",
        "stage": b"REJECTED",
        "attempt": b"0",
        "error": b"",
    }


def test_a_notice_is_no_outcome() -> None:
    notice = ReplyEntry(
        id="m-1", stage=Stage.WAITING, attempt=2, notice="replayed", error="a new answer follows"
    )

    assert names(reply_fields(notice)) == ["id", "stage", "attempt", "notice", "error"]
    parsed = parse_reply_entry(stored(reply_fields(notice)))
    assert parsed == notice and not notice.is_outcome
    assert ReplyEntry(id="m-1", stage=Stage.FAILED).is_outcome


def test_what_producers_and_older_brokers_wrote_still_reads() -> None:
    assert parse_reply_entry({"id": b"m-1", "stage": b"SUCCEEDED", "result": b'{"x": 0}'}) == (
        ReplyEntry(id="m-1", stage=Stage.SUCCEEDED, result=b'{"x": 0}')
    )
    assert parse_reply_entry({"id": b"m-1", "stage": b"PROCESSING", "notice": b"x"}) == (
        ReplyEntry(id="m-1", stage=Stage.PROCESSING, notice="x")
    )
    later = {"id": b"m-1", "stage": b"FAILED", "error": b"\xff no", "added_later": b"1"}
    assert parse_reply_entry(later) == ReplyEntry(id="m-1", stage=Stage.FAILED, error="\ufffd no")


def test_an_unreadable_reply_says_why() -> None:
    assert parse_reply_entry({"stage": b"FAILED"}) == "field 'id' is missing"
    assert parse_reply_entry({"id": b"m", "stage": b"NO-SUCH"}) == (
        "field 'stage' is no stage: b'NO-SUCH'"
    )
    assert str(parse_reply_entry({"id": b"m", "stage": b"FAILED", "attempt": b"-1"})).startswith(
        "field 'attempt' must be a whole number from 0"
    )
    deep = {"id": b"m", "stage": b"SUCCEEDED", "result": b"[" * 5000 + b"]" * 5000}
    assert str(parse_reply_entry(deep)).startswith("field 'result' is not JSON")
    broken = {"id": b"m", "stage": b"SUCCEEDED", "result": b'{"x": '}
    assert str(parse_reply_entry(broken)).startswith("field 'result' is not JSON")
    huge = {"id": b"m", "stage": b"SUCCEEDED", "result": b"[" + b"9" * 5000 + b"]"}
    assert str(parse_reply_entry(huge)).startswith("field 'result' is not JSON")
    assert answer_in(huge) is None  # never raises


@given(
    message_id=utf8_text,
    stage=stages,
    attempt=counts,
    result=st.one_of(st.none(), st.integers(), st.lists(utf8_text, max_size=3)).map(
        lambda value: None if value is None else msgspec.json.encode(value)
    ),
    error=st.one_of(st.none(), utf8_text),
    notice=st.one_of(st.none(), utf8_text),
)
def test_every_reply_entry_reads_back_as_written(
    message_id: str,
    stage: Stage,
    attempt: int,
    result: bytes | None,
    error: str | None,
    notice: str | None,
) -> None:
    entry = ReplyEntry(
        id=message_id,
        stage=stage,
        attempt=attempt,
        result=result,
        error=(error or "") if result is None else None,  # the writer puts one or the other
        notice=notice,
    )

    assert parse_reply_entry(stored(reply_fields(entry))) == entry


@given(fields=any_fields)
def test_any_reply_entry_is_an_entry_or_a_reason(fields: dict[str, bytes]) -> None:
    parsed = parse_reply_entry(fields)

    if isinstance(parsed, str):
        assert parsed
        return
    assert isinstance(parsed.stage, Stage) and parsed.attempt >= 0
    if parsed.result is not None:
        msgspec.json.decode(parsed.result)  # checked: a reader may decode it


# -- timelines -------------------------------------------------------------------------------


def test_what_the_lua_scripts_write_reads() -> None:
    # cjson escapes "/"; `note.lua` writes an event's name where a stage would be
    lua = b'["1700000000000","ROUTED","a-1","1","picked a\\/b"]'
    event = b'["1700000000001","CALLBACK_DELIVERED","","0",""]'

    assert parse_timeline_item(lua) == TimelineEntry(
        1_700_000_000_000, Stage.ROUTED, "a-1", 1, "picked a/b"
    )
    assert parse_timeline_item(event) == TimelineEntry(
        1_700_000_000_001, "CALLBACK_DELIVERED", "", 0, ""
    )


@given(
    ts_ms=counts,
    stage=st.one_of(stages, st.text(max_size=20)),
    instance=st.text(max_size=20),
    attempt=counts,
    reason=st.text(max_size=60),
)
def test_every_timeline_item_reads_back_as_written(
    ts_ms: int, stage: Stage | str, instance: str, attempt: int, reason: str
) -> None:
    known = {s.value: s for s in Stage}
    entry = TimelineEntry(ts_ms, known.get(stage, stage), instance, attempt, reason)

    assert parse_timeline_item(timeline_item_json(entry)) == entry


@given(
    raw=st.one_of(
        st.binary(max_size=80),
        st.lists(st.one_of(st.text(max_size=5), st.integers()), max_size=6).map(
            msgspec.json.encode
        ),
    )
)
def test_any_bytes_are_a_timeline_item_or_a_reason(raw: bytes) -> None:
    parsed = parse_timeline_item(raw)

    assert isinstance(parsed, str | TimelineEntry)
    if isinstance(parsed, TimelineEntry):
        assert parsed.ts_ms >= 0 and parsed.attempt >= 0


def test_an_unreadable_timeline_item_says_why() -> None:
    assert parse_timeline_item(b'["x","ROUTED","","1",""]') == (
        "timeline item's ts is not a whole number: 'x'"
    )
    assert parse_timeline_item(b"[1,2]").startswith("not a timeline item")


# -- dead letters ----------------------------------------------------------------------------


@given(flat=st.lists(any_values, max_size=12), entry_id=any_values)
def test_any_dead_letter_entry_reads_as_a_letter(flat: list[bytes], entry_id: bytes) -> None:
    letter = parse_letter(entry_id, flat)

    assert isinstance(letter, Letter) and letter.ts_ms >= 0


def test_a_letter_reads_back_as_written() -> None:
    letter = Letter(
        id="m-1",
        reason="callback_undeliverable",
        ts_ms=1_700_000_000_000,
        stage="SUCCEEDED",
        url="http://h/x",
        attempts=5,
        error="answered 500",
        body=b'{"id":"m-1"}',
        source="P:outbox 1-0",
    )
    flat = [v if isinstance(v, bytes) else str(v).encode() for v in letter_fields(letter, 1024)]

    assert parse_letter(b"1-0", flat) == letter


def test_a_number_too_long_to_be_ours_is_none() -> None:
    letter = parse_letter(b"5-0", [b"ts", b"9" * 5000, b"attempts", b"9" * 5000])

    assert (letter.ts_ms, letter.attempts) == (5, None)  # the entry id's time instead


def test_a_trace_shows_an_unreadable_item_as_such_and_reads_on() -> None:
    entry = timeline_entry(b'{"not": "an item"}')

    assert entry.stage == "UNREADABLE" and entry.reason.startswith("not a timeline item")


_names = st.sampled_from(["intent", "capability", "selectors", "state", "load", "score", "x:y"])
_steps = st.lists(
    st.one_of(
        st.builds(lambda n, k: {"step": n, "kept": k}, _names, st.integers(0, 10**6)),
        st.builds(
            lambda n, k, ex, more: {"step": n, "kept": k, "excluded": ex, "more_excluded": more},
            _names,
            st.integers(0, 10**6),
            st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
            st.integers(1, 100),
        ),
        st.builds(
            lambda s: {"step": "intent", "kept": 1, "layer": "rules", "score": s}, st.floats(0, 1)
        ),
    ),
    max_size=8,
)


@given(_steps)
def test_route_from_reads_back_as_written(steps: list[dict[str, object]]) -> None:
    assert route_steps(route_from_json(steps)) == steps


def test_a_step_that_excluded_nothing_is_written_short() -> None:
    steps = [
        {"step": "capability", "kept": 1},
        {"step": "selectors", "kept": 0, "excluded": {"a-1": "cost 5.0 over budget_per_task 2"}},
    ]
    written = route_from_json(steps)
    assert written.startswith(b'["capability:1",{"step":"selectors"')
    # what older records hold, every step an object, still reads
    assert route_steps(msgspec.json.encode(steps)) == steps


def printable(step: dict[str, object]) -> bool:
    """What `agent-reach trace` needs of a step to print it."""
    excluded = step.get("excluded", {})
    return (
        isinstance(step["step"], str)
        and type(step["kept"]) is int
        and isinstance(excluded, dict)
        and all(isinstance(v, str) for v in excluded.values())
        and type(step.get("more_excluded", 0)) is int
    )


@given(st.binary(max_size=200))
def test_route_from_of_any_bytes_reads_as_steps_or_none(raw: bytes) -> None:
    assert all(printable(step) for step in route_steps(raw))


def test_route_from_items_no_reader_could_print_are_left_out() -> None:
    odd = [
        "a:\u00b2",  # a superscript two: a digit to str.isdigit, not to int()
        "a:\u0663",  # an Arabic-Indic three
        "a:" + "9" * 40,
        {"step": "x"},
        {"step": "x", "kept": None},
        {"step": "x", "kept": True},
        {"step": "x", "kept": 1, "excluded": None},
        {"step": "x", "kept": 1, "excluded": ["a"]},
        {"step": "x", "kept": 1, "excluded": {"a": 1}},
        {"step": "x", "kept": 1, "more_excluded": "many"},
    ]
    assert route_steps(msgspec.json.encode([*odd, "ok:2"])) == [{"step": "ok", "kept": 2}]


@given(st.lists(st.one_of(st.text(max_size=30), st.integers(), st.none()), max_size=6))
def test_route_from_items_that_are_no_step_are_left_out(items: list[object]) -> None:
    for step in route_steps(msgspec.json.encode(items)):
        assert isinstance(step["step"], str) and isinstance(step["kept"], int)
