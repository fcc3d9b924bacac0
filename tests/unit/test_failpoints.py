"""Parsing the AGENT_REACH_FAILPOINTS specification."""

from __future__ import annotations

import pytest

from broker.failpoints import parse


def test_parse_two_points() -> None:
    assert parse("a=kill,b=kill") == {"a": "kill", "b": "kill"}


def test_parse_tolerates_spaces_and_empty_items() -> None:
    assert parse(" sidecar.after_received=kill , ,x=kill,") == {
        "sidecar.after_received": "kill",
        "x": "kill",
    }


@pytest.mark.parametrize("spec", ["", " ", ",", ", ,"])
def test_parse_empty(spec: str) -> None:
    assert parse(spec) == {}


@pytest.mark.parametrize("spec", ["a=explode", "a=kill,b=pause", "a", "a=", "a=KILL"])
def test_unknown_action_raises(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown action"):
        parse(spec)
