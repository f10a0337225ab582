"""A bandwidth-bounded link under processor sharing: upstream `bandwidth_sharing_model.rs`.

N active transfers each progress at B/N; when one completes the others speed up. The float
arithmetic follows upstream step by step (same operations, same order, the same 1e-9
completion tolerance) so deadlines agree with the Rust mocker to the last bit, and replaying
the same calls always gives the same answers.

Completion order. Upstream keeps the active set in a Vec, completes the *first* transfer
with the least remaining bytes, and removes it with `swap_remove`, which moves the last
transfer into the hole. That reordering is observable only among transfers that complete at
the same instant with equal remaining bytes: two such transfers complete in start order, but
three started together as A, B, C complete as A, C, B. The order reaches callers through the
ids `advance_to` returns (for G1->G2 batches: the order blocks are registered in G2 and their
Stored events). It is reproduced here exactly rather than "fixed" to FIFO.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

_COMPLETION_TOLERANCE_MS = 1e-9


class BandwidthLink:
    """One link's active transfers, advanced in virtual time by the caller.

    Time never rewinds: `advance_to` a time before the last update is a no-op, and a
    transfer started in the past starts at the last update instead. Callers must
    `advance_to(now)` before `start(now, ...)` while transfers are active, exactly as
    upstream's worker drains a link before reserving on it.
    """

    __slots__ = ("_ids", "_remaining", "_transfer_ids", "bytes_per_ms", "last_ms")

    def __init__(self, gbps: float, ids: Iterator[int] | None = None) -> None:
        """`gbps` in 1e9 bytes/s, <= 0 for infinite; `ids` may be shared between links."""
        self.bytes_per_ms = gbps * 1e6 if gbps > 0.0 else math.inf
        self.last_ms = 0.0
        self._ids = ids if ids is not None else itertools.count()
        self._transfer_ids: list[int] = []
        self._remaining: list[float] = []

    def is_idle(self) -> bool:
        return not self._transfer_ids

    def remaining_bytes(self) -> list[float]:
        """Bytes left per active transfer, in the link's (swap-remove) order."""
        return list(self._remaining)

    def start(self, now_ms: float, num_bytes: int) -> int:
        """Add a transfer of `num_bytes` at `now_ms` (clamped to the last update); its id."""
        if self._transfer_ids and now_ms > self.last_ms:
            raise RuntimeError("advance the link to now before starting a transfer")
        self.last_ms = max(now_ms, self.last_ms)
        transfer_id = next(self._ids)
        self._transfer_ids.append(transfer_id)
        self._remaining.append(float(num_bytes) if math.isfinite(self.bytes_per_ms) else 0.0)
        return transfer_id

    def advance_to(self, now_ms: float) -> list[int]:
        """Progress every transfer to `now_ms`; the ids that completed, in completion order."""
        completed: list[int] = []
        if now_ms < self.last_ms:
            return completed
        remaining = self._remaining
        bandwidth = self.bytes_per_ms
        while remaining:
            rate = bandwidth / len(remaining)
            finite = math.isfinite(rate)
            least = min(remaining)
            index = remaining.index(least)
            step = least / rate if finite and rate > 0.0 else 0.0
            event_ms = self.last_ms + step
            if event_ms > now_ms + _COMPLETION_TOLERANCE_MS:
                elapsed = now_ms - self.last_ms
                if finite and elapsed > 0.0:
                    self._deduct(elapsed * rate)
                self.last_ms = now_ms
                return completed
            if finite and step > 0.0:
                self._deduct(step * rate)
            self.last_ms = event_ms
            completed.append(self._swap_remove(index))
        self.last_ms = now_ms
        return completed

    def earliest_finish(self) -> float | None:
        """When the next completion happens if nothing else starts; None when idle.

        Every transfer with at least as much left as the smallest has progressed by that
        smallest amount by then, and smaller ones finished earlier: the link moves
        `sum(min(r, least))` bytes before the next completion.
        """
        remaining = self._remaining
        if not remaining:
            return None
        bandwidth = self.bytes_per_ms
        if not (math.isfinite(bandwidth) and bandwidth > 0.0):
            return self.last_ms
        least = min(remaining)
        moved = 0.0
        for r in remaining:
            moved += r if r < least else least
        return self.last_ms + moved / bandwidth

    def _deduct(self, delta: float) -> None:
        remaining = self._remaining
        for i, r in enumerate(remaining):
            left = r - delta
            remaining[i] = left if left > 0.0 else 0.0

    def _swap_remove(self, index: int) -> int:
        ids = self._transfer_ids
        remaining = self._remaining
        transfer_id = ids[index]
        last_id = ids.pop()
        last_remaining = remaining.pop()
        if index < len(ids):
            ids[index] = last_id
            remaining[index] = last_remaining
        return transfer_id
