"""An offload pipeline into one tier: policies, batching, bounded concurrency, registration.

Upstream's kvbm-engine pipeline, reduced to what can be observed in virtual time:

1. Policies, per block in order: PresenceFilter (skip a key already registered in the
   destination or already accepted and not yet settled), then CapacityReservationPolicy
   (skip unless `available - reserved >= 1`; an accepted block reserves one).
2. Accepted blocks of one submission are cut into batches of `batch_size`, queued FIFO
   behind earlier submissions.
3. At most `max_concurrent` batches are in flight. Starting a batch allocates its
   destination slots first (which may evict destination blocks: Removed events now), then
   puts one transfer of `n * block_bytes` on the link at the worker's time.
4. When the transfer completes, each block is registered (Stored events) and its handle
   dropped, so it becomes an inactive, evictable block; its reservation is released.

A batch whose destination cannot be allocated fails as a whole at start.

NOTE: upstream clears a key's "pending" mark when its batch is prepared for transfer, so
an identical key evicted again mid-transfer would be copied twice (the second registration
then collapses under Reject). Here a key stays pending until its batch settles; the only
difference is the redundant copy's bandwidth.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engined.core.offload.lanes import Lane
from engined.core.offload.tier import Tier
from engined.core.offload.tier_values import BlockMeta


class Item:
    """One block to copy: its identity, where it comes from, metadata for the destination.

    `source` is opaque here: a G1 slot for G1->G2, a pinned G2 block id for G2->G3.
    """

    __slots__ = ("key", "meta", "parent_key", "source")

    def __init__(
        self, key: int, parent_key: int | None, source: int, meta: BlockMeta | None
    ) -> None:
        self.key = key
        self.parent_key = parent_key
        self.source = source
        self.meta = meta


class Batch:
    __slots__ = ("dst_slots", "items", "owner", "transfer_id")

    def __init__(self, owner: int, items: list[Item]) -> None:
        self.owner = owner
        self.items = items
        self.dst_slots: list[int] = []
        self.transfer_id = -1


class TransferPipeline:
    __slots__ = (
        "_active",
        "_queue",
        "batch_size",
        "block_bytes",
        "dst",
        "lane",
        "max_concurrent",
        "pending",
    )

    def __init__(
        self, dst: Tier, lane: Lane, block_bytes: int, batch_size: int, max_concurrent: int
    ) -> None:
        self.dst = dst
        self.lane = lane
        self.block_bytes = block_bytes
        self.batch_size = batch_size
        self.max_concurrent = max(max_concurrent, 1)
        self.pending: set[int] = set()
        self._queue: deque[Batch] = deque()
        self._active: dict[int, Batch] = {}

    @property
    def num_batches(self) -> int:
        """Batches accepted and not yet settled (queued or in flight)."""
        return len(self._queue) + len(self._active)

    def evaluate(self, keys: Sequence[int]) -> list[bool]:
        """Run the policies over `keys` in order; accepted keys are reserved and pending."""
        dst = self.dst
        pending = self.pending
        accepted: list[bool] = []
        for key in keys:
            ok = key not in pending and not dst.contains(key) and dst.try_reserve(1)
            if ok:
                pending.add(key)
            accepted.append(ok)
        return accepted

    def submit(self, owner: int, items: list[Item], now_ms: float) -> list[Batch]:
        """Queue accepted items as batches and start what fits; the batches that failed."""
        size = self.batch_size
        for i in range(0, len(items), size):
            self._queue.append(Batch(owner, items[i : i + size]))
        return self.start_queued(now_ms)

    def start_queued(self, now_ms: float) -> list[Batch]:
        """Start queued batches while a transfer permit is free; the ones that failed."""
        failed: list[Batch] = []
        queue = self._queue
        link = self.lane.link
        while queue and len(self._active) < self.max_concurrent:
            batch = queue.popleft()
            slots = self.dst.allocate(len(batch.items))
            if slots is None:
                self._settle(batch)
                failed.append(batch)
                continue
            batch.dst_slots = slots
            batch.transfer_id = link.start(now_ms, len(batch.items) * self.block_bytes)
            self._active[batch.transfer_id] = batch
        return failed

    def complete(self, transfer_id: int) -> Batch:
        """Register a finished batch's blocks in the destination; the batch."""
        batch = self._active.pop(transfer_id)
        dst = self.dst
        for slot, item in zip(batch.dst_slots, batch.items, strict=True):
            dst.release(dst.register(slot, item.key, item.parent_key, item.meta))
        self._settle(batch)
        return batch

    def _settle(self, batch: Batch) -> None:
        self.dst.release_reservation(len(batch.items))
        pending = self.pending
        for item in batch.items:
            pending.discard(item.key)
