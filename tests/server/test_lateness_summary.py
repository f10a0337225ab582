"""`LatenessWindow.summary`: the p50/p99/max of pass-start lateness that `stats` reports.

Sorting the 100,000-pass window costs ~10 ms, so a long window is re-sorted at most every
LATENESS_SUMMARY_TTL_S once a summary of a long window was taken; a short one is cheap and
re-sorted whenever passes ran, so the first passes' lateness is never hidden behind a summary
taken before them. The clock is injected.
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
    # Long now, but the summary before was of a short window: taken again.
    assert window.summary() == (0.5, 0.5, 2.0)
    for _ in range(LATENESS_CHEAP_SORT):
        window.add(3.0)
    assert window.summary() == (0.5, 0.5, 2.0)  # a long window's summary waits the interval
    now[0] += LATENESS_SUMMARY_TTL_S
    assert window.summary() == (2.0, 3.0, 3.0)


def test_thousands_of_passes_after_an_empty_summary_are_reported_at_once() -> None:
    """CI: a heartbeat took the summary of an empty window, the compiled core then ran
    1,300-1,900 passes of 0.001 ms within the TTL, and `stats` reported their lateness as 0."""
    window = LatenessWindow(clock=lambda: 5.0)
    assert window.summary() == (0.0, 0.0, 0.0)
    for _ in range(2 * LATENESS_CHEAP_SORT):
        window.add(0.25)
    assert window.summary() == (0.25, 0.25, 0.25)
