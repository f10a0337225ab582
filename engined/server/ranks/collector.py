"""Garbage collection between passes, in the time before the next one is due.

CPython collects when allocations cross a threshold, so a collection runs inside whichever
pass (or command) made the allocation that crossed it, and delays every rank of the event
loop by its length. Measured with 8 paced ranks of 64 requests (prompt 512, output 128) on
the shared 2-core machine: 131 young collections inside passes (up to 4.6 ms), 11 of the
middle generation (p50 1.7 ms, up to 13.9 ms) and a full one (19.7 ms).

With a Collector started, the process's automatic collection is off. Each paced rank records
when it next needs the loop (engined.server.ranks.deadlines) and, about to sleep, offers the time
until then (`offer`): the collector runs the generation CPython would run once the earliest
deadline of every rank leaves twice that generation's last measured duration. A collection
that keeps finding no room runs anyway once allocations reach HARD_LIMIT times the young
threshold, so memory stays bounded and a loaded loop collects as CPython would, in larger
steps. The full generation waits for room too, up to HARD_LIMIT times its own threshold.

Unpaced ranks (speedup 0) have no deadlines: the daemon keeps CPython's collection for them,
with a young generation of UNPACED_YOUNG_THRESHOLD allocations (`YoungGeneration`) instead of
CPython's 700. Nearly everything a pass allocates dies by reference counting within the pass,
yet at 700 a young collection ran every few passes and walked whatever the pass held at that
moment: measured with e2e_throughput (2048 requests, speedup 0), ~190 young and ~17 middle
collections took ~0.1 s, ~4.5% of the daemon's CPU; at 20,000 there were 4, ~0.01 s.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Final, Protocol

from engined.server.ranks.deadlines import Deadlines

# Young allocations, in multiples of the young threshold, beyond which a collection runs
# without room; also the multiple of the full threshold beyond which a full one does.
HARD_LIMIT: Final = 20
# A generation's first collections before any was measured (seconds): cautious guesses.
INITIAL_COST_S: Final = (0.001, 0.005, 0.05)
# How fast a generation's cost estimate forgets a long collection (per collection).
COST_DECAY: Final = 0.8
# The young generation of a process whose ranks are unpaced (CPython's default is 700).
UNPACED_YOUNG_THRESHOLD: Final = 20_000


class GcOps(Protocol):
    """The part of the `gc` module the collector drives (the module itself, or a test's)."""

    def get_count(self) -> tuple[int, int, int]: ...

    def get_threshold(self) -> tuple[int, int, int]: ...

    def collect(self, generation: int = 2) -> int: ...

    def disable(self) -> None: ...

    def enable(self) -> None: ...


class Collector:
    """Runs the collections of one process's event loop in the gaps between its passes."""

    def __init__(
        self,
        deadlines: Deadlines,
        *,
        ops: GcOps | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`deadlines` are those of the ranks of the loop, on `clock`."""
        self._gc: GcOps = gc if ops is None else ops
        self._clock = clock
        self._deadlines = deadlines
        self._cost = list(INITIAL_COST_S)
        self._running = False
        self.collections = [0, 0, 0]
        # Collections that ran without the room they needed (HARD_LIMIT reached).
        self.forced = 0

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Take over from CPython's automatic collection (after the start-up heap is frozen)."""
        if not self._running:
            self._gc.disable()
            self._running = True

    def close(self) -> None:
        """Hand collection back to CPython."""
        if self._running:
            self._running = False
            self._gc.enable()

    def offer(self) -> None:
        """A rank is about to wait: collect now if a collection is due and there is room."""
        if not self._running:
            return
        counts = self._gc.get_count()
        thresholds = self._gc.get_threshold()
        if counts[0] <= thresholds[0]:
            return
        earliest = self._deadlines.earliest()
        room = float("inf") if earliest is None else earliest - self._clock()
        generation = self._generation(counts, thresholds, room)
        if generation is None:
            return
        if 2 * self._cost[generation] > room:
            self.forced += 1
        started = self._clock()
        self._gc.collect(generation)
        spent = self._clock() - started
        self._cost[generation] = max(spent, COST_DECAY * self._cost[generation])
        self.collections[generation] += 1

    def _generation(
        self, counts: tuple[int, int, int], thresholds: tuple[int, int, int], room: float
    ) -> int | None:
        """CPython's choice (the oldest generation past its threshold), if it fits in `room`
        or is past its hard limit; a full collection without room gives way to the middle one."""
        young, middle, old = counts
        if old > thresholds[2]:
            if 2 * self._cost[2] <= room or old > HARD_LIMIT * thresholds[2]:
                return 2
            generation = 1
        elif middle > thresholds[1]:
            generation = 1
        else:
            generation = 0
        if 2 * self._cost[generation] <= room or young > HARD_LIMIT * thresholds[0]:
            return generation
        return None


class ThresholdOps(Protocol):
    """The part of the `gc` module `YoungGeneration` drives (the module itself, or a test's)."""

    def get_threshold(self) -> tuple[int, int, int]: ...

    def set_threshold(self, young: int, middle: int, old: int, /) -> None: ...


class YoungGeneration:
    """CPython's automatic collection, with a wider young generation while unpaced ranks run.

    Only ever widens (a process already collecting less often keeps its setting), and
    `close` puts back what `start` found, as `Collector.close` hands collection back: a
    daemon run inside another program (the tests) leaves its collector as it was.
    """

    def __init__(self, young: int = UNPACED_YOUNG_THRESHOLD, *, ops: ThresholdOps | None = None):
        self._young = young
        self._gc: ThresholdOps = gc if ops is None else ops
        self._saved: tuple[int, int, int] | None = None

    def start(self) -> None:
        if self._saved is not None:
            return
        saved = self._saved = self._gc.get_threshold()
        if saved[0] < self._young:
            self._gc.set_threshold(self._young, saved[1], saved[2])

    def close(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            self._gc.set_threshold(*saved)
