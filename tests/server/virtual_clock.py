"""A clock whose seconds pass only when a task sleeps on it, for paced loops under test.

Tests that assert when something happened (a deadline wake-up, a pacing interval) must not
depend on how fast a shared machine runs: with this clock a 1 ms sleep takes exactly 1 ms of
clock time and no wall time. Concurrent sleepers wake in deadline order: a sleeper returns
only once it holds the earliest wake-up time, and moves the clock to it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class VirtualClock:
    """`clock()` reads seconds; `await clock.sleep(s)` moves them forward."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int]] = []
        self._ids = itertools.count()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        entry = (self.now + max(seconds, 0.0), next(self._ids))
        heapq.heappush(self._sleepers, entry)
        try:
            # Yield first, so a sleep of 0 still lets other tasks run, as asyncio.sleep does.
            await asyncio.sleep(0)
            while self._sleepers[0] != entry:
                await asyncio.sleep(0)
            self.now = max(self.now, entry[0])
        finally:
            self._sleepers.remove(entry)
            heapq.heapify(self._sleepers)


class ManualClock:
    """`clock()` reads seconds that move only when the test calls `advance_to`.

    Unlike `VirtualClock`, a sleeper never moves time itself: a test can send a command at an
    exact instant inside a paced wait, then look at what the loop did at that instant.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._waiters: list[asyncio.Future[None]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        wake_at = self.now + max(seconds, 0.0)
        await asyncio.sleep(0)
        while self.now < wake_at:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def parked(self) -> bool:
        """Whether a sleeper waits for the clock to move (a paced loop between passes)."""
        return any(not waiter.done() for waiter in self._waiters)

    def advance_to(self, seconds: float) -> None:
        self.now = max(self.now, seconds)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
