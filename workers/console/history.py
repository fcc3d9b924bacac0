"""The overview's recent past: totals read once a second, turned into rates and drawn as a
small chart (an SVG the page embeds: no charting script).

Pure: the console's sampler feeds :class:`History` with each reading it takes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..overview import Overview, rates_between

SERIES = {"accepted": "#2563eb", "SUCCEEDED": "#16a34a", "FAILED": "#dc2626"}


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    peak: float  # per second, at the top edge
    minutes: float  # the time the chart spans
    lines: dict[str, str]  # series -> SVG path data: one "M x,y L x,y ..." run per segment


Rates = tuple[int, dict[str, float]]  # a later reading's time, and the rates since the one before


class History:
    """The last ``keep`` readings' totals: ``(at_ms, totals, after_gap)``. No rate is counted
    across a gap (Redis away: :meth:`lost`) or a total that fell (the counts started again):
    the chart breaks there instead of drawing the outage as a slope."""

    def __init__(self, keep: int = 600) -> None:
        self.readings: deque[tuple[int, dict[str, int], bool]] = deque(maxlen=keep)
        self._gap = False

    def lost(self) -> None:
        """A reading failed: the next one starts a new segment."""
        self._gap = True

    def add(self, view: Overview) -> None:
        if self.readings and view.at_ms <= self.readings[-1][0]:
            return  # a clock step back: keep the series monotonic
        self.readings.append((view.at_ms, dict(view.totals), self._gap))
        self._gap = False

    def segments(self) -> list[list[Rates]]:
        """Per-second rates between consecutive readings, at each later reading's time, in
        runs broken where a gap or a fallen total came between two readings."""
        runs: list[list[Rates]] = [[]]
        pairs = zip(list(self.readings), list(self.readings)[1:], strict=False)
        for (t0, before, _), (t1, after, after_gap) in pairs:
            since = {} if after_gap else rates_between(t0, before, t1, after)
            if not since:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append((t1, since))
        return [run for run in runs if run]

    def rates(self) -> list[Rates]:
        return [r for run in self.segments() for r in run]

    def chart(self, width: int = 600, height: int = 120) -> Chart:
        runs = self.segments()
        if not runs:
            return Chart(width, height, 0.0, 0.0, dict.fromkeys(SERIES, ""))
        first, last = runs[0][0][0], runs[-1][-1][0]
        span = max(1, last - first)
        peak = max(max(r.values()) for run in runs for _, r in run) or 1.0
        lines = {}
        for name in SERIES:
            paths = (
                "M"
                + " L".join(
                    f"{(t - first) / span * width:.1f},{height - r[name] / peak * height:.1f}"
                    for t, r in run
                )
                for run in runs
            )
            lines[name] = " ".join(paths)
        return Chart(width, height, peak, span / 60000, lines)
