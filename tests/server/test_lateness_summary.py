"""`EngineLoop.lateness_summary`: the p50/p99/max of pass-start lateness that `stats` reports.

Sorting the 100,000-pass window costs ~10 ms, so a long window is re-sorted at most every
LATENESS_SUMMARY_TTL_S; a short one is cheap and re-sorted whenever passes ran, so the first
passes' lateness is never hidden behind a summary taken before them. The clock is injected.
"""

from __future__ import annotations

from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.server.engine_loop import (
    LATENESS_CHEAP_SORT,
    LATENESS_SUMMARY_TTL_S,
    EngineLoop,
)
from tests.server.test_metrics import _Sinks


def test_a_short_window_is_exact_and_a_long_one_is_resorted_per_interval() -> None:
    now = [0.0]
    sinks = _Sinks()
    loop = EngineLoop(
        Engine(EngineArgs(block_size=4, num_gpu_blocks=16).normalized()),
        kv=sinks,
        fpm=sinks,
        delivery=sinks,
        speedup_ratio=1.0,
        clock=lambda: now[0],
    )
    assert loop.lateness_summary() == (0.0, 0.0, 0.0)

    loop.lateness_ms.extend([1.0, 2.0])
    loop.passes_total = 2
    assert loop.lateness_summary() == (2.0, 2.0, 2.0)  # no time passed: the short window

    loop.lateness_ms.extend([0.5] * LATENESS_CHEAP_SORT)
    loop.passes_total += LATENESS_CHEAP_SORT
    assert loop.lateness_summary() == (2.0, 2.0, 2.0)  # a long window waits for the interval
    now[0] += LATENESS_SUMMARY_TTL_S
    assert loop.lateness_summary() == (0.5, 0.5, 2.0)
