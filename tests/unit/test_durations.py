"""Durations as an operator types them, and ages as a table shows them."""

from __future__ import annotations

import pytest

from broker.durations import format_age, parse_duration
from tests.unit.test_layering import BROKER, IO_LIBRARIES, imported_modules, top_levels


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("45", 45.0),
        ("0", 0.0),
        ("1.5m", 90.0),
        (".5h", 1800.0),
        (" 10 S ", 10.0),
        ("3M", 180.0),
    ],
)
def test_parse_duration_reads_units_and_plain_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "5x", "-5m", "5 m s", "1e3", "five", "5mm", "9" * 400])
def test_parse_duration_refuses_anything_else_and_says_what_it_expects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration: use a number with an optional unit"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (-3, "0s"),
        (42.9, "42s"),
        (60, "1m00s"),
        (425, "7m05s"),
        (3600, "1h00m"),
        (11_520, "3h12m"),
        (86_400, "1d00h"),
        (187_200, "2d04h"),
    ],
)
def test_format_age_is_short_and_exact_to_its_unit(seconds: float, shown: str) -> None:
    assert format_age(seconds) == shown


def test_durations_is_pure() -> None:
    """It is parsed by the CLI and may be used anywhere: no I/O library, no impure module."""
    names = imported_modules(BROKER / "durations.py")
    assert not top_levels(names) & IO_LIBRARIES
    assert not {n for n in names if n.startswith("broker.")}
