"""The G1 side of the offload tiers: what the KV manager does with an attached `TierEngine`.

The engine (engined/core/offload/) owns G2/G3 and the links; it never touches G1. This
module is the glue mocker 1.3.0 keeps in its `KvManager` (mocker-1.3.0.md §9.3-§9.5):

* Evicting allocations. With an engine attached, a G1 allocation that evicts registered
  blocks does not complete: the evicted blocks are offered to G2 and their slots stay held
  (active) until their copy has left G1. Every other slot of the allocation goes back to
  the free list, the GPU Removed is published now, and the caller either waits on the
  offload (`blocked`: the lease and its deadline) or, when nothing had to wait, retries the
  whole allocation once.
* Ticks. Tick effects are applied in the engine's order: lower-tier events published (medium
  CPU or STORAGE, ids from the manager's counter), G1 slots freed, pins dropped. NOTE: G3
  events (STORAGE) are published as the G2 ones are; upstream's shared G3 registry raises
  none, so a Dynamo router never learns of its disk tier. Each medium's stream is a
  consistent set of continuation edges (`parent, local hash -> block`): a block arrives in a
  lower tier before its parent does as often as not, which is how Dynamo's lower-tier index
  takes them, and every Removed names a block Stored earlier in that medium.
* Router metadata. A block offered to G2 carries the fields of its GPU Stored (sequence hash,
  parent hash, local hash, tokens), remembered here when that Stored is published. With
  publishing off nothing is remembered and the tiers publish nothing either.
* Swap-in landing: the blocks of a completed G2->G1 copy are registered in G1 as inactive
  blocks (GPU Stored for the new ones), ready to be hit by the request's next admission.

Nothing here runs unless an engine is attached: the manager branches once per evicting
allocation or published run, so a core without offload tiers pays nothing per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engined.core.offload.tier_engine import TierEngine
from engined.core.offload.types import (
    BlockMeta,
    EvictedBlock,
    OffloadWait,
    TickEffects,
    TierEventKind,
)
from engined.core.sequence import Sequence, Use
from engined.core.types import BlockRemoved, BlockStored

if TYPE_CHECKING:
    from engined.core.kv_manager import KvManager


class KvOffload:
    """An attached offload engine plus the G1 bookkeeping it needs."""

    __slots__ = ("blocked", "capacity_generation", "engine", "eviction_now_ms", "meta", "now_ms")

    def __init__(self, engine: TierEngine) -> None:
        self.engine = engine
        # Router metadata of published G1 blocks, by lineage key (publishing on only).
        self.meta: dict[int, BlockMeta] = {}
        # Worker time: the last tick's. Offloads start then unless a live command set
        # `eviction_now_ms` (its own application time) for the duration of the command.
        self.now_ms = 0.0
        self.eviction_now_ms: float | None = None
        # The offload the last failed allocation waits on; the caller takes it.
        self.blocked: OffloadWait | None = None
        # Upstream's KvManager counter of released slots (distinct from the core's).
        self.capacity_generation = 0

    # --- metadata -----------------------------------------------------------------------

    def remember(self, keys: list[int], event: BlockStored) -> None:
        """Keep the router fields of the blocks `event` just published on the GPU tier."""
        meta = self.meta
        bs = event.block_size
        tokens = event.token_ids
        parent = event.parent_hash
        for i, key in enumerate(keys):
            block_hash = event.block_hashes[i]
            meta[key] = BlockMeta(
                block_hash,
                parent,
                event.local_hashes[i],
                tokens[i * bs : (i + 1) * bs] if tokens else None,
            )
            parent = block_hash

    def forget(self, keys: list[int]) -> None:
        """The prefix cache was reset: routers dropped every tier of this rank.

        Blocks already in G2/G3 stay usable for swap-ins but publish nothing more, so no
        Removed can name a block routers no longer hold.
        """
        for key in keys:
            self.meta.pop(key, None)
        self.engine.g2.meta.clear()
        if self.engine.g3 is not None:
            self.engine.g3.meta.clear()

    # --- evicting allocations -----------------------------------------------------------

    def allocate(self, kv: KvManager, count: int) -> list[int] | None:
        """`count` mutable G1 slots, offloading what they evict; None if they cannot be had.

        On None, `blocked` says whether an offload is in flight (wait for it) or the pool is
        simply full (preempt or give up).
        """
        got = kv.pool.allocate(count)
        if got is None:
            self.blocked = None
            return None
        slots, evicted = got
        return self.settle(kv, slots, evicted) if evicted else slots

    def settle(self, kv: KvManager, slots: list[int], evicted: list[int]) -> list[int] | None:
        """Offer the registered blocks an allocation evicted to G2 (mocker-1.3.0.md §9.3).

        `slots` is what `BlockPool.allocate` returned: the evicted blocks' slots are its
        tail, in eviction order. Returns the allocation's slots (unchanged when nothing
        registered was evicted, else those of the retried allocation), or None with every
        slot and hit given back: then `blocked` holds the offload to wait for, if any.
        """
        self.blocked = None
        return self._settle(kv, slots, evicted, retry=True)

    def _settle(
        self, kv: KvManager, slots: list[int], evicted: list[int], *, retry: bool
    ) -> list[int] | None:
        pool = kv.pool
        registered = kv.registered
        meta = self.meta
        base = len(slots) - len(evicted)
        offered: list[EvictedBlock] = []
        hashes: list[int] = []
        for i, key in enumerate(evicted):
            block_hash = registered.pop(key, None)
            if block_hash is None:
                continue
            slot = slots[base + i]
            hashes.append(block_hash)
            offered.append(EvictedBlock(slot, key, pool.parent_key_of(slot), meta.pop(key, None)))
        if not offered:
            return slots
        kv.publish_removed(hashes)
        sources = {block.slot for block in offered}
        for slot in slots:
            if slot not in sources:
                pool.release_mutable(slot)
        now_ms = self.eviction_now_ms if self.eviction_now_ms is not None else self.now_ms
        outcome = self.engine.enqueue_g1_evictions(offered, now_ms)
        if isinstance(outcome, OffloadWait):
            self.blocked = outcome
            return None
        self.apply(kv, outcome.effects)
        if not retry:
            return None
        # Every slot of the first attempt is free again, so the retry evicts nothing more.
        got = pool.allocate(len(slots))
        if got is None:
            return None
        retried, evicted_again = got
        if evicted_again:
            return self._settle(kv, retried, evicted_again, retry=False)
        return retried

    def take_blocked(self) -> OffloadWait | None:
        blocked = self.blocked
        self.blocked = None
        return blocked

    # --- ticks --------------------------------------------------------------------------

    def tick(self, kv: KvManager, now_ms: float) -> None:
        """Advance the engine to `now_ms` and apply what finished."""
        self.now_ms = now_ms
        self.apply(kv, self.engine.tick(now_ms))

    def apply(self, kv: KvManager, effects: TickEffects) -> None:
        """Publish a tick's tier events, then give its G1 slots and pins back (§9.4)."""
        if effects.events and kv.publish:
            bs = kv.block_size
            dp_rank = kv.dp_rank
            for event in effects.events:
                block = event.block
                if event.kind is TierEventKind.STORED:
                    kv.push_event(
                        BlockStored(
                            kv.take_event_id(),
                            dp_rank,
                            block.parent_hash,
                            [block.seq_hash],
                            [block.local_hash if block.local_hash is not None else 0],
                            block.token_ids if block.token_ids is not None else [],
                            bs,
                            event.medium,
                        )
                    )
                else:
                    kv.push_event(
                        BlockRemoved(kv.take_event_id(), dp_rank, [block.seq_hash], event.medium)
                    )
        pool = kv.pool
        for slot in effects.released_g1_slots:
            pool.release_mutable(slot)
        for reaped in effects.reaped_onboards:
            for slot in reaped.slots:
                pool.release_mutable(slot)
            for pin in reaped.pins:
                pool.release(pin)
        self.capacity_generation += effects.released_count

    # --- swap-in ------------------------------------------------------------------------

    def pin_prefix(self, kv: KvManager, keys: list[int]) -> list[int] | None:
        """A handle on each cached G1 block of `keys` (all must be there), or None."""
        pool = kv.pool
        pins: list[int] = []
        for key in keys:
            block_id = pool.match(key)
            if block_id is None:
                for pin in pins:
                    pool.release(pin)
                return None
            pins.append(block_id)
        return pins

    def release_pins(self, kv: KvManager, pins: list[int]) -> None:
        for pin in pins:
            kv.pool.release(pin)

    def land_swap_in(
        self, kv: KvManager, seq: Sequence, skip: int, count: int, slots: list[int], pins: list[int]
    ) -> None:
        """Register the `count` blocks a swap-in copied after the `skip` cached ones.

        Each lands as an inactive G1 block (a later admission hits it); a block that reached
        G1 another way meanwhile keeps its copy and the slot is freed. New blocks are
        published as GPU Stored runs, split where a block was already present, whose parent
        is the block before the run. Then the prefix pins are dropped.
        """
        pool = kv.pool
        active_full = kv.active_full
        registered = kv.registered
        end = skip + count
        use = Use(
            skip,
            seq.hashes[skip:end],
            seq.keys[skip:end],
            seq.parent_keys[skip:end],
            seq.local[skip:end] if seq.caching else None,
            None,
            seq.hashes[skip - 1] if skip > 0 else None,
            seq.tokens if seq.emit_token_ids else None,
        )
        parent = use.parent
        run_parent = parent
        run: list[int] = []
        for j, slot in enumerate(slots[:count]):
            block_hash = use.hashes[j]
            key = use.keys[j]
            if block_hash in active_full or pool.is_registered(key):
                pool.release_mutable(slot)
                if run:
                    kv.store_run(use, run, run_parent)
                    run = []
                parent = block_hash
                continue
            if not run:
                run_parent = parent
            pool.release(pool.register(slot, key, use.parent_keys[j]))
            registered[key] = block_hash
            run.append(j)
            parent = block_hash
        if run:
            kv.store_run(use, run, run_parent)
        for slot in slots[count:]:
            pool.release_mutable(slot)
        self.release_pins(kv, pins)
