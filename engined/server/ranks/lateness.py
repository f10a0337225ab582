"""Pass-start lateness: how late each paced pass started against its schedule, and the
p50/p99/max that `stats` reports of the latest 100,000.

Sorting the full window costs ~10 ms and `stats` is a cheap message, so a long window is
re-sorted at most every LATENESS_SUMMARY_TTL_S, and only once a summary of a long window was
taken; otherwise (~0.05 ms to sort a short one) whenever a pass was added, so the first
passes' lateness is never hidden behind an older summary, even when more than
LATENESS_CHEAP_SORT passes ran since (a fast core at a tiny modelled pass runs thousands in a
TTL).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# Seconds of the loop's clock between re-sorts of a long window.
LATENESS_SUMMARY_TTL_S = 0.1
# A window of at most this many passes is re-sorted whenever it changed.
LATENESS_CHEAP_SORT = 1024
WINDOW = 100_000


class LatenessWindow:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.ms: deque[float] = deque(maxlen=WINDOW)
        self._added = 0
        self._summary: tuple[float, float, float] = (0.0, 0.0, 0.0)
        # (passes added, clock, window length) when the summary was taken.
        self._at: tuple[int, float, int] | None = None

    def add(self, late_ms: float) -> None:
        self.ms.append(late_ms)
        self._added += 1

    def summary(self) -> tuple[float, float, float]:
        """p50, p99 and max in ms (zeros before any paced pass)."""
        now = self._clock()
        cached = self._at
        if cached is not None and (
            cached[0] == self._added
            or (now - cached[1] < LATENESS_SUMMARY_TTL_S and cached[2] > LATENESS_CHEAP_SORT)
        ):
            return self._summary
        self._at = (self._added, now, len(self.ms))
        if not self.ms:
            self._summary = (0.0, 0.0, 0.0)
        else:
            ordered = sorted(self.ms)
            n = len(ordered)
            self._summary = (ordered[n // 2], ordered[min(n - 1, (99 * n) // 100)], ordered[-1])
        return self._summary
