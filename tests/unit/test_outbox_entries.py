"""Outbox entries as the notifier reads them: whatever bytes an entry holds, it gets a delivery
or a reason, never an exception (a running notifier meets the same battery in
``tests/integration/test_notifier.py``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.streams import field_name
from workers.webhook_settlement import Delivery, parse_delivery

GOOD = {
    "id": b"m-1",
    "webhook_id": b"m-1.2",
    "url": b"http://127.0.0.1:8080/hook",
    "body": b'{"id":"m-1"}',
    "attempt": b"3",
    "not_before_ms": b"1700000000000",
    "last_error": b"answered 500",
}


def test_a_good_entry() -> None:
    assert parse_delivery("reach:outbox", "1-0", GOOD) == Delivery(
        stream="reach:outbox",
        entry_id="1-0",
        message_id="m-1",
        webhook_id="m-1.2",
        url="http://127.0.0.1:8080/hook",
        body=b'{"id":"m-1"}',
        attempt=3,
        not_before_ms=1700000000000,
        last_error="answered 500",
    )


def test_what_older_brokers_wrote_still_reads() -> None:
    fields = {"id": b"m-1", "url": b"http://h/x", "body": b"{}"}

    delivery = parse_delivery("reach:outbox", "1-0", fields)

    assert isinstance(delivery, Delivery)
    assert (delivery.webhook_id, delivery.attempt, delivery.not_before_ms) == ("m-1", 1, 0)


def test_a_last_error_in_any_bytes_is_kept_readable() -> None:
    delivery = parse_delivery("reach:outbox", "1-0", {**GOOD, "last_error": b"\xff boom"})

    assert isinstance(delivery, Delivery) and delivery.last_error == "\ufffd boom"


def test_a_field_name_that_is_not_utf8_is_named_in_the_reason() -> None:
    fields = {**GOOD, field_name(b"\xfe\xffx"): b"1"}

    assert parse_delivery("reach:outbox", "7-1", fields) == (
        "malformed outbox entry 7-1: field name b'\\xfe\\xffx' is not UTF-8"
    )


names = st.one_of(st.sampled_from(list(GOOD)), st.binary(max_size=8).map(field_name))
values = st.one_of(
    st.binary(max_size=30),
    st.sampled_from([b"", b"0", b"-1", b"1", b"9" * 30, b" 2", b"1_0", b"\xd9\xa3", b"a\r\nb"]),
)


@given(fields=st.dictionaries(names, values, max_size=9))
def test_any_entry_gets_a_delivery_or_a_reason(fields: dict[str, bytes]) -> None:
    parsed = parse_delivery("reach:outbox", "1-0", fields)

    if isinstance(parsed, str):
        assert parsed.startswith("malformed outbox entry 1-0: ")
        return
    assert parsed.attempt >= 1 and parsed.not_before_ms >= 0
    for header in (parsed.message_id, parsed.webhook_id):
        assert header.isascii() and header.isprintable() and " " not in header
    parsed.body.decode()  # a receiver's verification decodes it


@given(changes=st.dictionaries(st.sampled_from(list(GOOD)), values, max_size=4))
def test_a_good_entry_with_any_field_changed(changes: dict[str, bytes]) -> None:
    parsed = parse_delivery("reach:outbox", "1-0", {**GOOD, **changes})

    assert isinstance(parsed, Delivery | str)
    if isinstance(parsed, Delivery):
        assert parsed.url == changes.get("url", GOOD["url"]).decode()
