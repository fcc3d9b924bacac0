"""What agents report as usage, read without trusting it, and how charges add up."""

from __future__ import annotations

import math
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from adapters.a2a_wire import outcome_of, task_view
from adapters.mcp_wire import reported_usage
from adapters.outcome import Failed, Succeeded
from broker.store import amount_arg
from broker.usage import (
    FIGURES,
    Usage,
    by_combination,
    charge,
    days_back,
    parse_since,
    spending,
    stored_usage,
    totals_by,
    usage_from_headers,
    usage_in_result,
)

JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def test_a_body_reports_usage_and_bad_figures_are_left_out() -> None:
    body = b'{"answer": 1, "usage": {"input_tokens": 5, "output_tokens": 7, "cost": 0.02}}'
    assert usage_in_result(body) == Usage(5, 7, 0.02)
    assert usage_in_result(b'{"usage": {"input_tokens": -1, "cost": "1"}}') is None
    assert usage_in_result(b'{"usage": {"input_tokens": 1.5, "output_tokens": true}}') is None
    assert usage_in_result(b'[{"usage": {"cost": 1}}]') is None  # not at the top
    assert usage_in_result(b'{"no": 1}') is None
    assert usage_in_result(b'{"usage": ') is None


def test_headers_report_usage_as_json_or_pairs() -> None:
    assert usage_from_headers('{"input_tokens": 3}', "0.5") == Usage(3, 0, 0.5)
    assert usage_from_headers("input_tokens=3, output_tokens = 4", None) == Usage(3, 4, 0.0)
    assert usage_from_headers(None, "1e3") == Usage(cost=1000.0)
    assert usage_from_headers("garbage", "nan") is None
    assert usage_from_headers("cost=inf", "-2") is None


@given(usage=st.text(max_size=200) | st.none(), cost=st.text(max_size=30) | st.none())
def test_no_header_makes_the_reader_raise(usage: str | None, cost: str | None) -> None:
    found = usage_from_headers(usage, cost)
    assert found is None or (found.input_tokens >= 0 and math.isfinite(found.cost))


@given(value=JSON)
def test_no_result_makes_the_reader_raise(value: Any) -> None:
    found = usage_in_result(msgspec.json.encode({"usage": value}))
    assert found is None or (found.output_tokens >= 0 and 0 <= found.cost <= 1e12)


@given(st.integers(min_value=-(10**400), max_value=10**400))
def test_an_integer_too_large_for_a_float_is_left_out_not_raised(n: int) -> None:
    body = b'{"usage": {"input_tokens": %d, "cost": %d}}' % (n, n)
    found = usage_in_result(body)
    assert found is None or (0 <= found.input_tokens and 0 <= found.cost <= 1e12)
    huge = b'{"usage": {"cost": 1' + b"0" * 400 + b', "output_tokens": 3}}'
    assert usage_in_result(huge) == Usage(output_tokens=3)


def test_a_charge_counts_the_attempt_and_what_it_reported() -> None:
    first = charge("a", "c.d", None, attempt=1, answered=False, busy_ms=3.6, usage=None, ms=0)
    assert first.figures == {"requests": 1, "busy_ms": 4, "failed": 1}
    assert first.tenant == "-" and first.combination == "a\tc.d\t-"
    again = charge(
        "a", "c.d", "t", attempt=2, answered=True, busy_ms=1, usage=Usage(1, 0, 0.5), ms=0
    )
    assert again.figures["retried"] == 1 and again.figures["succeeded"] == 1
    assert again.figures["reported"] == 1 and again.spend == 0.5
    declined = charge("a", "c.d", "t", attempt=1, answered=None, busy_ms=0, usage=None, ms=0)
    assert "succeeded" not in declined.figures and "failed" not in declined.figures


def test_day_hashes_sum_by_dimension_and_skip_what_does_not_read() -> None:
    day = {
        b"a\tc.d\tt1\trequests": b"2",
        b"a\tc.d\tt1\tcost": b"0.5",
        b"b\tc.d\tt2\trequests": b"1",
        b"b\tc.d\tt2\tcost": b"1.5",
        b"spend\tt1": b"0.5",
        b"broken": b"1",
        b"a\tc.d\tt1\tnope": b"9",
        b"a\tc.d\tt1\tfailed": b"x",
    }
    rows = totals_by([day, {b"a\tc.d\tt1\trequests": b"1"}], "agent")
    assert [(r.name, r.figures["requests"], r.figures["cost"]) for r in rows] == [
        ("b", 1, 1.5),
        ("a", 3, 0.5),
    ]
    assert totals_by([day], "capability")[0].figures["requests"] == 3
    assert spending(day) == {"t1": 0.5}
    assert by_combination([day])[("a", "c.d", "t1")]["requests"] == 2


def test_figures_no_script_writes_are_left_out_so_every_sum_stays_finite() -> None:
    """A sidecar's user may write a day's hash: `1e308` twice summed to infinity, and the
    usage page's count of retries failed `int`."""
    day = {
        b"a\tc.d\tt1\tretried": b"1e308",
        b"a\tc.d\tt2\tretried": b"1e308",
        b"a\tc.d\tt3\tretried": b"2",
        b"a\tc.d\tt4\tcost": b"nan",
        b"spend\tt1": b"inf",
    }
    [row] = totals_by([day], "agent")

    assert row.figures["retried"] == 2 and row.figures["cost"] == 0
    assert spending(day) == {}


def test_combinations_past_the_cap_are_summed_into_one() -> None:
    day = {f"a{n}\tc.d\tt\tcost".encode(): str(n).encode() for n in range(1, 13)}

    kept = by_combination([day], most=10)

    assert len(kept) == 11 and kept[("~other", "~other", "~other")]["cost"] == 1 + 2
    assert ("a12", "c.d", "t") in kept and ("a1", "c.d", "t") not in kept
    assert len(by_combination([day])) == 12


def test_spans_are_whole_utc_days() -> None:
    assert parse_since("7d") == 7 and parse_since("24h") == 1 and parse_since("2w") == 14
    assert parse_since("25h") == 2
    assert days_back(86_400_000 * 3, 2) == ["1970-01-03", "1970-01-04"]
    for bad in ("0d", "forever", "-1d", "99999d"):
        try:
            parse_since(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a2a_and_mcp_answers_report_usage_in_their_metadata() -> None:
    task = {
        "id": "t1",
        "status": {"state": "TASK_STATE_COMPLETED"},
        "metadata": {"usage": {"input_tokens": 9, "cost": 0.1}},
    }
    view = task_view(task)
    assert not isinstance(view, str)
    assert outcome_of(view) == Succeeded(view.result, Usage(9, 0, 0.1))
    failed = task_view({**task, "status": {"state": "failed"}})
    assert not isinstance(failed, str)
    assert isinstance(outcome := outcome_of(failed), Failed) and outcome.usage == Usage(9, 0, 0.1)
    answer = {"result": {"content": [], "_meta": {"usage": {"output_tokens": 4}}}}
    assert reported_usage(answer) == Usage(output_tokens=4)
    assert reported_usage({"result": {"_meta": "x"}}) is None


def test_a_stored_usage_reads_back_what_was_written() -> None:
    usage = Usage(input_tokens=10, output_tokens=2, cost=0.125)
    assert stored_usage(msgspec.json.encode(usage)) == usage
    assert stored_usage(None) is None and stored_usage(b"") is None
    assert stored_usage(b'{"cost": "a lot"}') is None  # nothing usable in it
    assert stored_usage(b"[1, 2") is None
    assert stored_usage(b"[" * 100_000) is None  # too deep for the decoder


@given(st.binary(max_size=200) | JSON.map(msgspec.json.encode))
def test_a_stored_usage_never_raises_on_what_anyone_wrote(raw: bytes) -> None:
    found = stored_usage(raw)
    assert found is None or isinstance(found, Usage)


@given(
    st.sampled_from(FIGURES),
    st.floats(min_value=0, allow_nan=False, allow_infinity=False) | st.integers(0, 10**15),
)
def test_an_amount_goes_as_digits_only_when_it_is_a_whole_count_exactly(
    figure: str, value: float
) -> None:
    text = amount_arg(figure, value)
    assert float(text) == float(value)  # the script adds what was charged, either way
    whole = float(value).is_integer() and float(value) < 2**53
    assert text.isdigit() == (whole and figure != "cost")


def test_amounts_as_the_script_reads_them() -> None:
    counts = [amount_arg("busy_ms", v) for v in (1, 12.0, 0.25, 2.0**53, 1e300)]
    assert counts == ["1", "12", "0.25", "9007199254740992.0", "1e+300"]
    assert [amount_arg("cost", v) for v in (1, 0.25)] == ["1.0", "0.25"]
