"""The overview's recent past: totals read once a second, turned into rates and drawn as a
small chart (an SVG the page embeds: no charting script).

Pure: the console's sampler feeds :class:`History` with each reading it takes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..overview import TOTALS, Overview

SERIES = {"accepted": "#2563eb", "SUCCEEDED": "#16a34a", "FAILED": "#dc2626"}


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    peak: float  # per second, at the top edge
    minutes: float  # the time the chart spans
    lines: dict[str, str]  # series -> SVG polyline points


class History:
    """The last ``keep`` readings' totals: ``(at_ms, totals)``."""

    def __init__(self, keep: int = 600) -> None:
        self.readings: deque[tuple[int, dict[str, int]]] = deque(maxlen=keep)

    def add(self, view: Overview) -> None:
        if self.readings and view.at_ms <= self.readings[-1][0]:
            return  # a clock step back: keep the series monotonic
        self.readings.append((view.at_ms, dict(view.totals)))

    def rates(self) -> list[tuple[int, dict[str, float]]]:
        """Per-second rates between consecutive readings, at each later reading's time."""
        out = []
        pairs = zip(list(self.readings), list(self.readings)[1:], strict=False)
        for (t0, before), (t1, after) in pairs:
            seconds = (t1 - t0) / 1000
            out.append(
                (t1, {n: max(0, after.get(n, 0) - before.get(n, 0)) / seconds for n in TOTALS})
            )
        return out

    def chart(self, width: int = 600, height: int = 120) -> Chart:
        rates = self.rates()
        if not rates:
            return Chart(width, height, 0.0, 0.0, dict.fromkeys(SERIES, ""))
        first, last = rates[0][0], rates[-1][0]
        span = max(1, last - first)
        peak = max(max(r.values()) for _, r in rates) or 1.0
        lines = {}
        for name in SERIES:
            points = (
                f"{(t - first) / span * width:.1f},{height - r[name] / peak * height:.1f}"
                for t, r in rates
            )
            lines[name] = " ".join(points)
        return Chart(width, height, peak, span / 60000, lines)
