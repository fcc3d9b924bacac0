"""Durations as an operator types them: ``90s``, ``5m``, ``2h``, ``1d`` or plain seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in ``text``; :class:`ValueError` saying what is expected when it is not one."""
    match = _DURATION.match(text)
    seconds = float(match[1]) * _UNITS[match[2].lower()] if match else math.nan
    if not math.isfinite(seconds):
        raise ValueError(
            f"{text!r} is not a duration: use a number with an optional unit s, m, h or d "
            "(e.g. 90s, 5m, 2h; plain numbers are seconds)"
        )
    return seconds


def format_age(seconds: float) -> str:
    """A short age for a table: ``42s``, ``7m05s``, ``3h12m``, ``2d04h``."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
