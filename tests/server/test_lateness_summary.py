"""`LatenessWindow.summary`: the p50/p99/max of pass-start lateness that `stats` reports.

Sorting the 100,000-pass window costs ~10 ms, so a long window is re-sorted at most every
LATENESS_SUMMARY_TTL_S; a short one is cheap and re-sorted whenever passes ran, so the first
passes' lateness is never hidden behind a summary taken before them. The clock is injected.
"""

from __future__ import annotations

from engined.server.ranks.lateness import (
    LATENESS_CHEAP_SORT,
    LATENESS_SUMMARY_TTL_S,
    LatenessWindow,
)


def test_a_short_window_is_exact_and_a_long_one_is_resorted_per_interval() -> None:
    now = [0.0]
    window = LatenessWindow(clock=lambda: now[0])
    assert window.summary() == (0.0, 0.0, 0.0)

    for late_ms in [1.0, 2.0]:
        window.add(late_ms)
    assert window.summary() == (2.0, 2.0, 2.0)  # no time passed: the short window

    for _ in range(LATENESS_CHEAP_SORT):
        window.add(0.5)
    assert window.summary() == (2.0, 2.0, 2.0)  # a long window waits for the interval
    now[0] += LATENESS_SUMMARY_TTL_S
    assert window.summary() == (0.5, 0.5, 2.0)
