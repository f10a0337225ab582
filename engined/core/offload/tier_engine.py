"""`TierEngine`: the observable contract of upstream `MockOffloadEngine`, in virtual time.

The KV manager's G1 glue (g1_glue.py) drives one. It offers the engine the registered G1
blocks the manager's allocations evict (G1 -> G2 offload), asks it for lower-tier prefix
hits (G2 -> G1 onboard, staging G3 through G2, for the parking), and ticks it at every pass
entry. The engine is pure: no clock, no I/O, no
randomness; time is the `now_ms` each call is given, and replaying the same calls gives the
same effects.

Time. Pipeline transfers (G1->G2 batches, G2->G3 copies, G3->G2 staging) start at the
worker's clock, which upstream stores in whole microseconds: `now_ms` truncated to 1e-3 ms.
Onboard G2->G1 transfers start at `now_ms` itself. Link completions use `now_ms` exactly.

Offload leases. One `enqueue_g1_evictions` call is one lease. Its evicted blocks are
filtered (already in G2, or already on their way: PresenceFilter; no room left:
CapacityReservationPolicy), the rest go out in batches. A lease lives until its last batch
settles; `offload_wait` reports it until the tick that retires it.
G1 source slots come back at the tick their batch lands (copied blocks) or at the tick the
lease ends (filtered blocks), exactly once each.

Metadata. The router metadata of a block is remembered by key when G2 accepts its copy,
and forgotten when the block leaves G2 (publishing Removed) or when its batch fails without
the key reaching G2. NOTE: upstream remembers the metadata of every offered block, filtered
ones included, and forgets filtered blocks' entries when their lease ends; a block offered
again while its earlier copy sits in G2 (or is in flight) thereby loses its entry, so its
eviction is never published and routers keep a stale host-tier block (or a Removed arrives
for a block never Stored). Here filtered blocks leave the map alone, so each tier's event
stream stays consistent: every Removed names a block Stored earlier in that medium.

G3. With `num_g3_blocks`, every block a G1->G2 batch lands is also copied G2 -> G3 in the
background (same two policies against G3, batches of `offload_batch_size`, one batch in
flight), its G2 block pinned until the copy lands. G3 registrations publish Stored with
medium STORAGE and G3 evictions Removed STORAGE, for blocks whose metadata was known when
the copy was queued. NOTE: upstream's shared G3 registry has no events manager (in the
source read for this port), so upstream publishes no STORAGE events; a caller wanting that
drops the STORAGE drafts. The G3 pool here belongs to this engine, while upstream shares
one G3 pool (and its links) between every engine of a process.

Ordering inside a tick: (1) advance all links; (2) land G1->G2 batches in completion order,
then start queued batches; (3) land G2->G3 copies, start the queued one; (4) land G3->G2
staging; (5) flip finished onboards to COMPLETED; (6) queue the G2->G3 copies of what
landed in (2), lease by lease in lease id order; (7) start the G2->G1 hop of staged
onboards; (8) release source slots lease by lease in id order (landed slots in landing
order, then filtered ones in offer order), retire finished leases, reap cancelled
onboards. Events are returned in the order they happened, including those raised between
ticks (G2 evictions when a batch or a staging copy allocates), which wait for the next tick.
"""

from __future__ import annotations

import math

from engined.core.offload.config import OffloadConfig
from engined.core.offload.lanes import LanePair
from engined.core.offload.link import BandwidthLink
from engined.core.offload.pipeline import Batch, Item, TransferPipeline
from engined.core.offload.tier import Tier
from engined.core.offload.tier_onboard import OnboardPlan, Onboards
from engined.core.offload.tier_values import (
    EvictedBlock,
    LandedOnboard,
    OffloadOutcome,
    OnboardStatus,
    RetryNow,
    TickEffects,
    TierEvent,
)
from engined.core.types import Medium, OffloadWait


class _Lease:
    """One G1->G2 enqueue: the G1 slots it holds and what its next tick must release."""

    __slots__ = ("chain", "filtered_slots", "forget", "id", "landed", "outstanding")

    def __init__(self, lease_id: int) -> None:
        self.id = lease_id
        self.outstanding = 0
        self.filtered_slots: list[int] = []
        self.landed: list[int] = []
        self.forget: list[int] = []
        self.chain: list[int] = []


def worker_clock(now_ms: float) -> float:
    """Upstream's worker time: `now_ms` clamped at 0 and truncated to whole microseconds."""
    if not math.isfinite(now_ms):
        raise ValueError(f"offload time must be finite, got {now_ms}")
    return int(max(now_ms, 0.0) * 1000.0) / 1000.0


class TierEngine:
    """Lower tiers of one engine: G2 (host) and optionally G3 (disk) with their links."""

    __slots__ = (
        "_dirty",
        "_events",
        "_g1_to_g2",
        "_g2_to_g3",
        "_leases",
        "_local",
        "_next_id",
        "_onboards",
        "_shared",
        "config",
        "g2",
        "g3",
    )

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self._events: list[TierEvent] = []
        self.g2 = Tier(config.num_g2_blocks, Medium.CPU, self._events)
        self.g3 = (
            Tier(config.num_g3_blocks, Medium.STORAGE, self._events)
            if config.num_g3_blocks is not None
            else None
        )
        self._local = LanePair(config.bandwidth_g1_to_g2_gbps, config.bandwidth_g2_to_g1_gbps)
        self._shared = (
            LanePair(config.bandwidth_g2_to_g3_gbps, config.bandwidth_g3_to_g2_gbps)
            if self.g3 is not None
            else None
        )
        batch = config.offload_batch_size
        self._g1_to_g2 = TransferPipeline(
            self.g2, self._local.offload, config.block_bytes, batch, batch
        )
        self._g2_to_g3 = (
            TransferPipeline(self.g3, self._shared.offload, config.block_bytes, batch, 1)
            if self.g3 is not None and self._shared is not None
            else None
        )
        self._onboards = Onboards(self.g2, self.g3, self._local, self._shared, config.block_bytes)
        self._leases: dict[int, _Lease] = {}
        self._dirty: dict[int, _Lease] = {}
        self._next_id = 1

    # --- queries ------------------------------------------------------------------------

    def earliest_pending_deadline(self) -> float | None:
        """The next time a tick changes something: min over every link's next completion.

        Includes the background G2->G3 link, whose completions unpin G2 blocks.
        """
        deadlines = [self._local.deadline()]
        if self._shared is not None:
            deadlines.append(self._shared.deadline())
        present = [d for d in deadlines if d is not None]
        return min(present) if present else None

    def offload_wait(self, lease_id: int) -> OffloadWait | None:
        """The wait on `lease_id`, its deadline refreshed, while the lease lives; else None."""
        if lease_id not in self._leases:
            return None
        return OffloadWait(lease_id, self._local.offload.deadline())

    def onboard_status(self, onboard_id: int) -> OnboardStatus | None:
        """PENDING(count) / COMPLETED(count) / CANCELLED once cancel was asked; None if gone.

        A staged onboard reports PENDING(0) until its G3->G2 copy lands.
        """
        return self._onboards.status(onboard_id)

    def is_idle(self) -> bool:
        """No lease, no onboard, no transfer: nothing a tick could change."""
        shared_idle = self._shared is None or self._shared.is_idle()
        g3_idle = self._g2_to_g3 is None or self._g2_to_g3.num_batches == 0
        return (
            not self._leases
            and not self._dirty
            and len(self._onboards) == 0
            and self._local.is_idle()
            and shared_idle
            and g3_idle
        )

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def links(self) -> list[BandwidthLink]:
        """Every link (G1->G2, G2->G1, then G2->G3, G3->G2 with G3), for inspection."""
        pairs = [self._local] if self._shared is None else [self._local, self._shared]
        return [lane.link for pair in pairs for lane in (pair.offload, pair.onboard)]

    # --- G1 -> G2 -----------------------------------------------------------------------

    def enqueue_g1_evictions(self, blocks: list[EvictedBlock], now_ms: float) -> OffloadOutcome:
        """Offer evicted G1 blocks to G2; the engine holds their slots until they are copied.

        Returns `OffloadWait(lease, deadline)` while copies are in flight. When nothing has to
        wait (every block filtered, every batch failed, or no transfer left on the link),
        upstream ticks at once and the caller retries its allocation: `RetryNow(effects)`.

        Raises:
            ValueError: `blocks` is empty (upstream never offers an empty eviction).
        """
        if not blocks:
            raise ValueError("no evicted blocks to offload")
        worker_ms = worker_clock(now_ms)
        lease = _Lease(self._take_id())
        self._leases[lease.id] = lease
        meta = self.g2.meta
        accepted = self._g1_to_g2.evaluate([block.key for block in blocks])
        items: list[Item] = []
        for block, ok in zip(blocks, accepted, strict=True):
            if ok:
                if block.meta is not None:
                    meta[block.key] = block.meta
                items.append(Item(block.key, block.parent_key, block.slot, None))
            else:
                lease.filtered_slots.append(block.slot)
        size = self.config.offload_batch_size
        lease.outstanding = -(-len(items) // size)
        if items:
            self._local.drain(worker_ms)
            self._settle_failed(self._g1_to_g2.submit(lease.id, items, worker_ms))
        else:
            self._dirty[lease.id] = lease
        if lease.outstanding == 0 or self._local.offload.link.is_idle():
            return RetryNow(self.tick(worker_ms))
        return OffloadWait(lease.id, self._local.offload.deadline())

    # --- onboard ------------------------------------------------------------------------

    def prepare_onboard(self, keys: list[int]) -> OnboardPlan | None:
        """A lower-tier hit for `keys` (the blocks after the cached G1 prefix), or None.

        A G2-only plan pins its G2 blocks now; a staging plan reserves G2 room for its G3
        run. Start it, or give it back with `abandon_onboard` when no G1 slots are free.
        """
        return self._onboards.prepare(keys)

    def abandon_onboard(self, plan: OnboardPlan) -> None:
        self._onboards.abandon(plan)

    def start_onboard(
        self, plan: OnboardPlan, g1_slots: list[int], pins: list[int], now_ms: float
    ) -> int:
        """Start copying `plan` into `g1_slots` (exactly `plan.block_count` of them).

        `pins` are the caller's handles on the cached G1 prefix; the engine keeps slots and
        pins until `take_completed_onboard`, or until a cancelled onboard is reaped. The
        onboard may land fewer blocks than slots (`OnboardStatus.block_count`) when its plan
        was cut short; the caller frees the unused slots. Returns the onboard id.
        """
        worker_ms = worker_clock(now_ms)
        onboard_id = self._take_id()
        self._onboards.start(onboard_id, plan, g1_slots, pins, now_ms, worker_ms)
        return onboard_id

    def take_completed_onboard(self, onboard_id: int) -> LandedOnboard | None:
        """The `(slots, pins)` of a COMPLETED onboard, which then ends; None otherwise."""
        return self._onboards.take_completed(onboard_id)

    def cancel_onboard(self, onboard_id: int) -> bool:
        """Give up on an onboard; its slots and pins come back at the tick its copy ends."""
        return self._onboards.cancel(onboard_id)

    # --- tick ---------------------------------------------------------------------------

    def tick(self, now_ms: float) -> TickEffects:
        """Advance every link to `now_ms` and apply what finished (see the module docs)."""
        worker_ms = worker_clock(now_ms)
        local = self._local
        shared = self._shared
        local.drain(now_ms)
        if shared is not None:
            shared.drain(now_ms)
        effects = TickEffects()

        pipeline = self._g1_to_g2
        chain = self._g2_to_g3 is not None
        for transfer_id in local.offload.take():
            batch = pipeline.complete(transfer_id)
            lease = self._leases[batch.owner]
            for item in batch.items:
                lease.landed.append(item.source)
                if chain:
                    lease.chain.append(item.key)
            lease.outstanding -= 1
            self._dirty[lease.id] = lease
        self._settle_failed(pipeline.start_queued(worker_ms))

        onboards = self._onboards
        if shared is not None and self._g2_to_g3 is not None:
            g2 = self.g2
            for transfer_id in shared.offload.take():
                for item in self._g2_to_g3.complete(transfer_id).items:
                    g2.release(item.source)
            self._release_g2_sources(self._g2_to_g3.start_queued(worker_ms))
            for transfer_id in shared.onboard.take():
                onboards.stage_landed(transfer_id)

        for transfer_id in local.onboard.take():
            onboard_id = onboards.onboard_done(transfer_id)
            if onboard_id is not None:
                effects.completed_onboards.append(onboard_id)

        dirty = [self._dirty[lease_id] for lease_id in sorted(self._dirty)]
        self._dirty.clear()
        if chain:
            for lease in dirty:
                if lease.chain:
                    self._copy_to_g3(lease.chain, worker_ms)
                    lease.chain = []
        onboards.pump(now_ms)

        released = effects.released_g1_slots
        meta = self.g2.meta
        for lease in dirty:
            released.extend(lease.landed)
            lease.landed = []
            for key in lease.forget:
                if not self.g2.contains(key):
                    meta.pop(key, None)
            lease.forget = []
            if lease.outstanding == 0:
                released.extend(lease.filtered_slots)
                del self._leases[lease.id]
        effects.reaped_onboards = onboards.reap()
        effects.events = self._events[:]
        self._events.clear()
        return effects

    # --- test and replay helpers --------------------------------------------------------

    def seed_g2(self, key: int, parent_key: int | None = None) -> None:
        """An inactive G2 block without metadata (publishes nothing), as upstream's tests."""
        self.g2.seed(key, parent_key)

    def seed_g3(self, key: int, parent_key: int | None = None) -> None:
        if self.g3 is None:
            raise RuntimeError("this engine has no G3 tier")
        self.g3.seed(key, parent_key)

    # --- internals ----------------------------------------------------------------------

    def _take_id(self) -> int:
        next_id = self._next_id
        self._next_id = next_id + 1
        return next_id

    def _settle_failed(self, failed: list[Batch]) -> None:
        """Batches that found no G2 room: sources go back, metadata of keys not in G2 goes."""
        for batch in failed:
            lease = self._leases[batch.owner]
            for item in batch.items:
                lease.landed.append(item.source)
                lease.forget.append(item.key)
            lease.outstanding -= 1
            self._dirty[lease.id] = lease

    def _copy_to_g3(self, keys: list[int], worker_ms: float) -> None:
        """Queue background G2->G3 copies of blocks that just landed in G2.

        Every key still in G2 is pinned first, and the ones the policies refuse are unpinned
        at once (re-inserted as the newest inactive blocks), as upstream scans then filters.
        """
        g2 = self.g2
        pipeline = self._g2_to_g3
        shared = self._shared
        assert pipeline is not None and shared is not None
        pinned: list[tuple[int, int]] = []
        for key in keys:
            block_id = g2.match(key)
            if block_id is not None:
                pinned.append((key, block_id))
        if not pinned:
            return
        accepted = pipeline.evaluate([key for key, _ in pinned])
        items: list[Item] = []
        for (key, block_id), ok in zip(pinned, accepted, strict=True):
            if ok:
                items.append(Item(key, g2.parent_of(key), block_id, g2.meta.get(key)))
            else:
                g2.release(block_id)
        if items:
            shared.drain(worker_ms)
            self._release_g2_sources(pipeline.submit(0, items, worker_ms))

    def _release_g2_sources(self, failed: list[Batch]) -> None:
        g2 = self.g2
        for batch in failed:
            for item in batch.items:
                g2.release(item.source)
