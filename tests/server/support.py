"""Helpers shared by the server tests: a rank's stats, bounded polls of them, idleness, and
a delivery that records which requests finished (for engine loops run without a server).

Plain functions, imported as `tests.server.support` (pytest's conftest.py is for fixtures).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engined.client import EngineClient
from engined.core.types import LifecycleEvent, RequestOutput
from engined.wire.control import RankStats

WAIT_S = 10.0
POLL_S = 0.005


async def rank0(client: EngineClient, *, timeout: float = WAIT_S) -> RankStats:
    """The stats of a single-rank daemon's only rank."""
    stats = await client.stats(timeout=timeout)
    assert len(stats.ranks) == 1
    return stats.ranks[0]


def assert_idle(stats: RankStats, total_blocks: int | None = None) -> None:
    """No active block, nothing running or waiting; with `total_blocks`, also the seed's
    `assert_scheduler_idle` (usage 0.0 and the pool size)."""
    assert (stats.active_blocks, stats.waiting, stats.running) == (0, 0, 0), stats
    if total_blocks is not None:
        assert stats.kv_cache_usage == 0.0, stats
        assert stats.total_blocks == total_blocks, stats


async def wait_for_stats(
    client: EngineClient,
    predicate: Callable[[RankStats], bool],
    what: str = "the condition",
    *,
    timeout: float = WAIT_S,
) -> RankStats:
    """Poll `stats` until `predicate` holds for rank 0; fails with the last stats at the
    deadline. (A poll interval, not synchronisation.)"""
    deadline = time.monotonic() + timeout
    while True:
        stats = await rank0(client)
        if predicate(stats):
            return stats
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s: {stats}")
        await asyncio.sleep(POLL_S)


class FinishedDelivery:
    """An engine loop's `Delivery` that keeps the ids of the requests that finished."""

    def __init__(self) -> None:
        self.finished: set[str] = set()

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput]) -> None:
        self.finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        pass
