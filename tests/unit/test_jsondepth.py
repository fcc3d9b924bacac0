"""The nesting measure taken before decoding JSON from outside (``broker.jsondepth``)."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.jsondepth import MAX_JSON_DEPTH, depth_problem, json_depth


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
