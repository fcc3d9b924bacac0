"""Fleet events read back without trusting a byte, heartbeat changes, subscription matching."""

from __future__ import annotations

import threading

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.event_follow import just_before, resume_point
from broker.event_log import PAGE
from broker.events import (
    EVENT_TYPES,
    Event,
    detail_text,
    event_body,
    event_fields,
    heartbeat_events,
    parse_event,
    types_problem,
)
from broker.records import CircuitState, InstanceStats
from broker.subscriptions import Subscription, decode_subscriptions, subscription_problem


@given(st.dictionaries(st.text(max_size=12), st.binary(max_size=64), max_size=6))
def test_any_entry_reads_as_an_event_or_a_reason(fields: dict[str, bytes]) -> None:
    assert isinstance(parse_event("1-0", fields), Event | str)


@given(st.sampled_from(EVENT_TYPES), st.text(max_size=40).filter(str.isprintable))
def test_what_event_fields_writes_reads_back(kind: str, subject: str) -> None:
    written = {k: v.encode() for k, v in event_fields(kind, subject, 5, n=1).items()}
    event = parse_event("5-0", written)
    assert isinstance(event, Event)
    body = msgspec.json.decode(event_body(event))
    assert body == {"type": kind, "subject": subject, "ts": 5, "detail": {"n": 1}, "id": "5-0"}


def test_a_detail_that_is_no_object_is_refused() -> None:
    fields = {"type": b"circuit.opened", "subject": b"a", "ts": b"1", "detail": b"[1]"}
    assert isinstance(parse_event("1-0", fields), str)


def stats(circuit: CircuitState) -> InstanceStats:
    return InstanceStats(error_rate=0.6, p95_ms=1.0, requests=10, successes=4, circuit=circuit)


def test_heartbeat_changes_become_events() -> None:
    assert heartbeat_events("UP", "UP", "closed", stats(CircuitState.CLOSED)) == []
    opened = heartbeat_events("UP", "DOWN", "closed", stats(CircuitState.OPEN))
    assert [kind for kind, _ in opened] == ["instance.state_changed", "circuit.opened"]
    assert opened[0][1]["from"] == "UP" and opened[0][1]["to"] == "DOWN"
    assert heartbeat_events("DOWN", "DOWN", "open", stats(CircuitState.HALF_OPEN)) == []
    closed = heartbeat_events("DOWN", "DOWN", "half_open", stats(CircuitState.CLOSED))
    assert [kind for kind, _ in closed] == ["circuit.closed"]


def test_subscriptions_match_their_types_or_everything() -> None:
    assert Subscription(url="http://h/").matches("message.dead")
    only = Subscription(url="http://h/", events=("circuit.opened",))
    assert only.matches("circuit.opened") and not only.matches("circuit.closed")


def test_unreadable_stored_subscriptions_are_left_out_with_a_reason() -> None:
    good = msgspec.json.encode(Subscription(url="http://h/", events=("message.dead",)))
    found, problems = decode_subscriptions({b"s1": good, b"s2": b"{", b"s3": b"[" * 5000})
    assert list(found) == ["s1"] and len(problems) == 2


def test_a_subscription_is_checked_like_a_callback_url() -> None:
    assert types_problem(["x.y"]) is not None
    assert "instance.gone" in (subscription_problem("http://127.0.0.1/", ["x.y"], [], "k") or "")
    assert "not allowed" in (
        subscription_problem("http://a.example/", [], ["127.0.0.1"], "k") or ""
    )
    assert "webhook_secret" in (
        subscription_problem("http://127.0.0.1/", [], ["127.0.0.1"], None) or ""
    )
    assert subscription_problem("http://127.0.0.1/", ["message.dead"], ["127.0.0.1"], "k") is None
    longest = "http://127.0.0.1/" + "a" * (2048 - 17)
    assert subscription_problem(longest, [], ["127.0.0.1"], "k") is None
    assert "longer than 2048" in (subscription_problem(longest + "a", [], ["127.0.0.1"], "k") or "")


@pytest.mark.parametrize(
    "url",
    [
        "http://hook:hunter2@h.example/" + "a" * 2048,  # too long
        "ftp://hook:hunter2@h.example/",  # not http(s)
        "http://hook:hunter2/x@h.example/",  # an unencoded / in it: "hunter2" is the port
        "http://h.example/e?token=hunter2&x=" + "a" * 2048,  # a secret parameter
    ],
)
def test_a_refused_url_is_said_without_its_password(url: str) -> None:
    said = subscription_problem(url, [], ["h.example"], "k")
    assert said is not None and "hunter2" not in said and "<hidden>" in said
    if len(url) > 130:  # quoted in part, with the length of the URL itself
        assert f"({len(url)} characters)" in said


def test_no_message_id_passes_for_an_event_delivery() -> None:
    import re as _re

    from broker.envelope import MESSAGE_ID_PATTERN
    from broker.events import delivery_ids, is_event_delivery

    outbox_id, _ = delivery_ids("1-0", "s1")
    assert is_event_delivery(outbox_id)
    assert not _re.match(MESSAGE_ID_PATTERN, outbox_id)
    assert not is_event_delivery("event.x")  # a producer's message id


def test_a_detail_with_terminal_escapes_is_printed_escaped() -> None:
    from broker.events import detail_text

    shown = detail_text(b'{"reason": "agent said \\u001b[2J\\rgone"}')
    assert "\x1b" not in shown and "\r" not in shown
    assert "\\x1b[2J\\rgone" in shown


READ = {"3-0", "4-0", "5-0"}  # what the follower read lately; the last read is 5-0


@pytest.mark.parametrize(
    ("last", "tail", "oldest", "position", "said"),
    [
        ("5-0", ["9-0", "5-0", "4-0"], "1-0", "5-0", None),  # all there: on after the last
        ("5-0", ["5-0", "4-0"], "1-0", "5-0", None),  # nothing new yet
        ("0-0", [], None, "0-0", None),  # nothing read, nothing there
        ("5-0", [], None, "0-0", "gone"),  # came back without its data: from its start
        # a failover lost 5-0; the new node wrote 4-5 (a clock behind) and 9-0 since
        ("5-0", ["9-0", "4-5", "4-0", "3-0"], "1-0", "4-0", "no longer holds 5-0"),
        # a new stream, its ids below the last read (a clock behind): from its start
        ("5-0", ["2-0", "1-0"], "1-0", "0-0", "a new one"),
        ("5-0", ["9-0", "8-0"], "8-0", "5-0", "8-0, past 5-0, the last read"),  # trimmed
    ],
)
def test_following_resumes_where_the_stream_allows_and_says_what_it_lost(
    last: str, tail: list[str], oldest: str | None, position: str, said: str | None
) -> None:
    where, lost = resume_point(last, READ, tail, oldest)
    assert where == position
    assert (lost is None) if said is None else (lost is not None and said in lost)


def test_a_full_page_none_of_it_read_is_followed_from_its_oldest() -> None:
    tail = [f"{n}-0" for n in range(PAGE + 100, 100, -1)][:PAGE]
    where, lost = resume_point("5-0", READ, tail, "1-0")
    assert where == just_before(tail[-1]) and lost is not None and tail[-1] in lost
    assert just_before("7-3") == "7-2" and just_before("7-0") == f"6-{2**64 - 1}"


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ("ok\u2028fake line", "ok\\u2028fake line"),
        ("ok\u2029para", "ok\\u2029para"),
        ("pay \u202eusd 001\u202c", "pay \\u202eusd 001\\u202c"),  # right-to-left override
        ("\u2066isolate\u2069 \u200fmark\u200e", "\\u2066isolate\\u2069 \\u200fmark\\u200e"),
        ("zero\u200bwidth\ufeff\u061c", "zero\\u200bwidth\\ufeff\\u061c"),
        ("soft\u00adhy\u2060phen", "soft\\xadhy\\u2060phen"),
        ("tag\U000e0041 nbsp\u00a0", "tag\\U000e0041 nbsp\\xa0"),
        ("\U0001f468\u200d\U0001f469", "\U0001f468\\u200d\U0001f469"),
        (
            "caf\u00e9 \u4e2d \u0645\u0631\u062d\u0628\u0627 ok",
            "caf\u00e9 \u4e2d \u0645\u0631\u062d\u0628\u0627 ok",
        ),
    ],
)
def test_printable_escapes_what_would_reorder_or_break_a_line(stored: str, shown: str) -> None:
    from broker.events import printable

    assert printable(stored) == shown


def test_a_detail_too_deep_to_write_out_again_is_shown_as_stored() -> None:
    """A detail nested deep enough to decode (976 levels) and too deep for json.dumps to
    write again ended `agent-reach events` with a RecursionError. Whether it is depends on
    the stack it is called at (a window a few frames wide): every depth up to a hundred
    frames is tried, from a thread's shallow stack."""
    detail = b'{"a":' + b"[" * 976 + b"]" * 976 + b"}"
    shown: list[str] = []
    failed: list[BaseException] = []

    def called_at(depth: int) -> str:
        return detail_text(detail) if depth == 0 else called_at(depth - 1)

    def every_depth() -> None:
        try:
            shown.extend(called_at(depth) for depth in range(100))
        except BaseException as exc:  # said by the assertion below
            failed.append(exc)

    thread = threading.Thread(target=every_depth)
    thread.start()
    thread.join()
    assert not failed, failed
    assert len(shown) == 100
    assert all(s.startswith(("a=[[[", '{"a":[[[')) and s.count("[") == 976 for s in shown)
