"""The nesting measure taken before decoding JSON from outside (``broker.jsondepth``)."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.jsondepth import (
    MAX_JSON_DEPTH,
    decode_error_text,
    depth_problem,
    json_depth,
    json_problem,
)


def reference_depth(text: str) -> int:
    """The same measure, one character at a time: slow and plainly right."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def value_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(value_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(value_depth, value), default=0)
    return 0


tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\ab:,é\n'), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=40,
)


@given(json_values, st.sampled_from([None, 0, 2]), st.booleans())
def test_the_depth_of_any_json_value_however_it_is_written(
    value: Any, indent: int | None, ensure_ascii: bool
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    assert json_depth(text) == value_depth(value)
    assert json_depth(text.encode()) == value_depth(value)


@given(st.text(alphabet=st.sampled_from('[]{}"\\a,: '), max_size=200))
def test_any_text_measures_as_the_plain_reading_does(text: str) -> None:
    """Broken JSON included: unclosed openers count, an unterminated string runs on."""
    assert json_depth(text) == reference_depth(text)


@given(st.binary(max_size=300))
def test_any_bytes_are_measured_without_error(data: bytes) -> None:
    assert json_depth(data) >= 0


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[[["', 0),
        ("[]", 1),
        ('{"a": [1, {"b": "]]"}]}', 3),
        ('["\\"[", []]', 2),
        ('["\\\\", [[]]]', 3),
        ("[[[", 3),  # never closed: the decoder recurses in before it finds out
        ('["unterminated [[[[', 1),
    ],
)
def test_strings_hold_text_not_structure(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_the_limit_is_inclusive_and_the_reason_says_how_deep() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    past = "[" + at_limit + "]"

    assert depth_problem(at_limit) is None
    problem = depth_problem(past)
    assert problem is not None
    assert f"{MAX_JSON_DEPTH + 1} levels deep" in problem and f"at most {MAX_JSON_DEPTH}" in problem
    assert depth_problem("[[[]]]", limit=2) is not None


def test_what_passes_the_limit_decodes_without_recursion_error() -> None:
    """The limit is far below where the decoder's recursion breaks."""
    at_limit = b'{"a": ' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH
    assert depth_problem(at_limit) is None
    msgspec.json.decode(at_limit)
    with pytest.raises(RecursionError):  # what the measure protects against
        msgspec.json.decode(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 500_000 + b"]" * 500_000,
        b"[" + b"[]," * 333_333 + b"[]]",
        b'"\\"' * 330_000,  # many stray quotes and escapes: no quadratic search
        b'["' + b"\\\\" * 500_000 + b'"]',
        b'"' + b"x" * 1_000_000,
    ],
    ids=["deep", "wide", "quotes", "escapes", "unterminated"],
)
def test_a_megabyte_is_measured_quickly(body: bytes) -> None:
    started = time.perf_counter()
    json_depth(body)
    assert time.perf_counter() - started < 1.0  # milliseconds on any machine; 1 s on a busy one


def decode_error(text: bytes) -> msgspec.DecodeError:
    with pytest.raises(msgspec.DecodeError) as caught:
        msgspec.json.decode(text)
    return caught.value


@pytest.mark.parametrize(
    ("text", "escape", "at"),
    [
        (rb'"\ud800"', r"\ud800", 1),
        (rb'{"a": "x\uDBFF"}', r"\uDBFF", 8),
        (rb'"\ud800\n"', r"\ud800", 1),
        (rb'["ok", "\\\ud9ab', r"\ud9ab", 10),  # a literal backslash, then the escape
    ],
)
def test_a_lone_surrogate_is_named_not_called_truncated(text: bytes, escape: str, at: int) -> None:
    said = decode_error_text(decode_error(text), text)

    assert said.startswith("JSON is malformed: a lone UTF-16 surrogate")
    assert f"{escape} at byte {at}" in said
    assert "truncated" not in said


@pytest.mark.parametrize("text", [b'{"a": [1, 2', rb'"\\ud800', b'"abc'])
def test_text_that_is_truly_cut_off_is_still_called_truncated(text: bytes) -> None:
    assert decode_error_text(decode_error(text), text) == "Input data was truncated"


def test_other_errors_are_said_as_msgspec_says_them() -> None:
    text = b'"\\ud800" trailing'
    assert decode_error_text(decode_error(text), text) == str(decode_error(text))


def test_json_problem_names_a_lone_surrogate_in_str_text() -> None:
    problem = json_problem('{"a": "\\udbff"}')

    assert problem is not None and "lone UTF-16 surrogate \\udbff" in problem


@given(st.text())
def test_decode_error_text_never_raises_on_text_that_fails(text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        assert decode_error_text(exc, data)
