"""The G1 side of the offload tiers: what the KV manager does with an attached `TierEngine`.

The tier engine owns G2/G3 and the links; it never touches G1. This glue is what mocker
1.3.0 keeps in its `KvManager` (docs/upstream/dynamo-mocker.md §6.1-§6.3). The KV manager owns it
and builds it from its pool and its event log; the glue never sees the manager itself.

* Evicting allocations. With tiers attached, a G1 allocation that evicts registered blocks
  does not complete: the evicted blocks are offered to G2 and their slots stay held (active)
  until their copy has left G1. Every other slot of the allocation goes back to the free
  list, the GPU Removed is published now, and the caller either waits on the offload
  (`wait`: an `OffloadWait`) or, when nothing had to wait, retries the whole allocation once.
* Ticks. Tick effects are applied in the engine's order: lower-tier events published (medium
  CPU or STORAGE, ids from the rank's one counter), G1 slots freed, pins dropped. NOTE: G3
  events (STORAGE) are published as the G2 ones are; upstream's shared G3 registry raises
  none, so a Dynamo router never learns of its disk tier. Each medium's stream is a
  consistent set of continuation edges (`parent, local hash -> block`): a block arrives in a
  lower tier before its parent does as often as not, which is how Dynamo's lower-tier index
  takes them, and every Removed names a block Stored earlier in that medium.
* Router metadata. A block offered to G2 carries the fields of its GPU Stored (sequence hash,
  parent hash, local hash, tokens), remembered here when that Stored is published. With
  publishing off nothing is remembered and the tiers publish nothing either.
* Onboard landing: the blocks of a completed G2->G1 copy are registered in G1 as inactive
  blocks (GPU Stored for the new ones), ready to be hit by the request's next admission.

Nothing here runs unless tiers are attached: the manager branches once per evicting
allocation or published run, so an engine without offload tiers pays nothing per token.
"""

from __future__ import annotations

from engined.core.block_moves import Use
from engined.core.hashing import hash_of_key
from engined.core.kv_event_log import KvEventLog
from engined.core.lineage_pool import BlockPool
from engined.core.offload.tier_engine import TierEngine
from engined.core.offload.tier_values import (
    BlockMeta,
    EvictedBlock,
    TickEffects,
    TierEventKind,
)
from engined.core.sequence import Sequence
from engined.core.types import BlockStored, OffloadWait


class G1Glue:
    """An attached tier engine plus the G1 bookkeeping it needs."""

    __slots__ = ("engine", "log", "meta", "pool", "wait")

    def __init__(self, engine: TierEngine, pool: BlockPool, log: KvEventLog) -> None:
        self.engine = engine
        self.pool = pool
        self.log = log
        # Router metadata of published G1 blocks, by lineage key (publishing on only).
        self.meta: dict[int, BlockMeta] = {}
        # The offload wait of the last failed allocation; the caller takes it.
        self.wait: OffloadWait | None = None

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

        Blocks already in G2/G3 stay usable for onboards but publish nothing more, so no
        Removed can name a block routers no longer hold.
        """
        for key in keys:
            self.meta.pop(key, None)
        self.engine.g2.meta.clear()
        if self.engine.g3 is not None:
            self.engine.g3.meta.clear()

    # --- offload waits ------------------------------------------------------------------

    def take_wait(self) -> OffloadWait | None:
        wait = self.wait
        self.wait = None
        return wait

    def refresh(self, wait: OffloadWait) -> OffloadWait | None:
        """`wait` with its deadline refreshed while its lease lives; None once it ended."""
        return self.engine.offload_wait(wait.lease_id)

    # --- evicting allocations -----------------------------------------------------------

    def allocate(self, count: int, now_ms: float) -> list[int] | None:
        """`count` mutable G1 slots, offloading what they evict from `now_ms` on; None if
        they cannot be had.

        On None, `wait` says whether an offload is in flight (wait for it) or the pool is
        simply full (preempt or give up).
        """
        got = self.pool.allocate(count)
        if got is None:
            self.wait = None
            return None
        slots, evicted = got
        return self.settle(slots, evicted, now_ms) if evicted else slots

    def settle(self, slots: list[int], evicted: list[int], now_ms: float) -> list[int] | None:
        """Offer the registered blocks an allocation evicted to G2 (docs/upstream/dynamo-mocker.md
        §6.1).

        `slots` is what `BlockPool.allocate` returned and `evicted` (not empty) the keys it
        evicted: their slots are its tail, in eviction order; the pool evicts registered
        blocks only. The offload starts at `now_ms`, the time of the engine call that
        allocates (a pass, a tier advance, a command), which the caller passes down: the
        tiers are ticked to that time at a pass or advance, and a command does not tick them.
        Returns the retried allocation's slots, or None with every slot and hit given back:
        then `wait` holds the offload to wait for, if any.
        """
        self.wait = None
        return self._settle(slots, evicted, now_ms, retry=True)

    def _settle(
        self, slots: list[int], evicted: list[int], now_ms: float, *, retry: bool
    ) -> list[int] | None:
        pool = self.pool
        meta = self.meta
        base = len(slots) - len(evicted)
        offered: list[EvictedBlock] = []
        hashes: list[int] = []
        # Every evicted key was registered: the pool only evicts registered blocks.
        for i, key in enumerate(evicted):
            slot = slots[base + i]
            hashes.append(hash_of_key(key))
            offered.append(EvictedBlock(slot, key, pool.parent_key_of(slot), meta.pop(key, None)))
        self.log.removed(hashes)
        sources = {block.slot for block in offered}
        for slot in slots:
            if slot not in sources:
                pool.release_mutable(slot)
        outcome = self.engine.enqueue_g1_evictions(offered, now_ms)
        if isinstance(outcome, OffloadWait):
            self.wait = outcome
            return None
        self.apply(outcome.effects)
        if not retry:
            return None
        # Every slot of the first attempt is free again, so the retry evicts nothing more.
        got = pool.allocate(len(slots))
        if got is None:
            return None
        retried, evicted_again = got
        if evicted_again:
            return self._settle(retried, evicted_again, now_ms, retry=False)
        return retried

    # --- ticks --------------------------------------------------------------------------

    def tick(self, now_ms: float) -> None:
        """Advance the engine to `now_ms` and apply what finished."""
        self.apply(self.engine.tick(now_ms))

    def apply(self, effects: TickEffects) -> None:
        """Publish a tick's tier events, then give its G1 slots and pins back (§6.2)."""
        log = self.log
        if effects.events and log.publish:
            for event in effects.events:
                block = event.block
                if event.kind is TierEventKind.STORED:
                    log.stored_block(
                        block.parent_hash,
                        block.seq_hash,
                        block.local_hash,
                        block.token_ids,
                        event.medium,
                    )
                else:
                    log.removed([block.seq_hash], event.medium)
        pool = self.pool
        for slot in effects.released_g1_slots:
            pool.release_mutable(slot)
        for reaped in effects.reaped_onboards:
            for slot in reaped.slots:
                pool.release_mutable(slot)
            for pin in reaped.pins:
                pool.release(pin)

    # --- onboard ------------------------------------------------------------------------

    def pin_prefix(self, keys: list[int]) -> list[int] | None:
        """A handle on each cached G1 block of `keys` (all must be there), or None."""
        pool = self.pool
        pins: list[int] = []
        for key in keys:
            block_id = pool.match(key)
            if block_id is None:
                for pin in pins:
                    pool.release(pin)
                return None
            pins.append(block_id)
        return pins

    def release_pins(self, pins: list[int]) -> None:
        pool = self.pool
        for pin in pins:
            pool.release(pin)

    def land_onboard(
        self, seq: Sequence, skip: int, count: int, slots: list[int], pins: list[int]
    ) -> None:
        """Register the `count` blocks an onboard copied after the `skip` cached ones.

        Each lands as an inactive G1 block (a later admission hits it); a block that reached
        G1 another way meanwhile keeps its copy and the slot is freed. New blocks are
        published as GPU Stored runs, split where a block was already present, whose parent
        is the block before the run. Then the prefix pins are dropped.
        """
        pool = self.pool
        end = skip + count
        use = Use(
            skip,
            seq.hashes[skip:end],
            seq.keys[skip:end],
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
            if pool.is_registered(key):
                pool.release_mutable(slot)
                if run:
                    self._store_run(use, run, run_parent)
                    run = []
                parent = block_hash
                continue
            if not run:
                run_parent = parent
            pool.release(pool.register(slot, key, use.parent_key(j)))
            run.append(j)
            parent = block_hash
        if run:
            self._store_run(use, run, run_parent)
        for slot in slots[count:]:
            pool.release_mutable(slot)
        self.release_pins(pins)

    def _store_run(self, use: Use, run: list[int], parent: int | None) -> None:
        event = self.log.stored_run(use, run, parent)
        if event is not None:
            self.remember(use.keys[run[0] : run[-1] + 1], event)
