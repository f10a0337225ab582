"""KV block residency samples: vLLM's `KVCacheMetricsCollector` (`--kv-cache-metrics`).

vLLM samples a fraction of the blocks it hands out (`--kv-cache-metrics-sample`, 1% by
default) and, when a sampled block's slot is handed out again, reports how long it lived,
how long it sat since its last prefix hit, and the gaps between its last four hits
(vllm/v1/core/kv_cache_metrics.py). Its block pool calls the collector where ours calls
this: allocation (`get_new_blocks`, which also ends the previous tenant's record), a prefix
hit (`touch`) and a reset of the cache.

vLLM stamps the calls with the wall clock; here they carry the core's clock as of the call
that runs them (`now_ms`, set by the engine at each pass and command), so the figures are
modeled time like every other latency. vLLM draws from the process-wide `random`; a private
generator seeded per rank keeps a run repeatable.
"""

from __future__ import annotations

import random

from engined.core.kv_residency import KvBlockEviction

# vLLM keeps a block's last four hits (`deque(maxlen=4)`): at most three gaps.
HISTORY = 4


class BlockResidency:
    """The sampled blocks of one pool, and the evictions not yet reported."""

    __slots__ = ("_born", "_draw", "_hits", "_last", "_rate", "evictions")

    def __init__(self, sample_rate: float, seed: int) -> None:
        self._rate = sample_rate
        self._draw = random.Random(seed).random
        self._born: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._hits: dict[int, list[float]] = {}
        self.evictions: list[KvBlockEviction] = []

    def allocated(self, block: int, now: float) -> None:
        """`block` was handed out at `now` (ms): its previous tenant's record ends, a new one
        may start."""
        born = self._born.pop(block, None)
        if born is not None:
            hits = self._hits.pop(block)
            gaps = tuple([hits[i] - hits[i - 1] for i in range(1, len(hits))])
            self.evictions.append(KvBlockEviction(now - born, now - self._last.pop(block), gaps))
        if self._draw() < self._rate:
            self._born[block] = now
            self._last[block] = now
            self._hits[block] = []

    def touched(self, block: int, now: float) -> None:
        """A prefix hit took `block` at `now` (ms)."""
        hits = self._hits.get(block)
        if hits is None:
            return
        self._last[block] = now
        hits.append(now)
        if len(hits) > HISTORY:
            del hits[0]

    def reset(self) -> None:
        """The prefix cache was reset: every record is dropped, unreported (as vLLM does)."""
        self._born.clear()
        self._last.clear()
        self._hits.clear()
        self.evictions.clear()

    def take(self) -> list[KvBlockEviction]:
        """The evictions since the last call (a new list: the result keeps it)."""
        taken = self.evictions
        self.evictions = []
        return taken
