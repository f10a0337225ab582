"""Per-request KV allocation over the block pool, and the KV events it causes.

The sequence says which blocks it needs (`Use`, `Deref`, `Promote`); this module makes it so
and queues the events a real vLLM worker would publish for it:

* `BlockStored` when a block is registered for the first time (at allocation: eager, as in
  mocker 1.3.0), at promotion of a completed partial block, and at destination activation.
  Consecutive fresh blocks share one event; an already-present block splits the run, and the
  next run's parent is that block. Hits never re-publish.
* `BlockRemoved` only when inactive blocks are evicted to make room, after the Stored events
  of the same allocation. Completion, preemption and cancel only make blocks inactive.

With prefix caching off nothing is published and event ids never advance.

The events go to the rank's `KvEventLog`; the maps of held blocks live in a `BlockRegistry`
beside the pool, which alone knows which blocks are registered.

With offload tiers attached (`attach_tiers`), an allocation that evicts registered blocks
goes through the G1 glue instead (engined/core/offload/g1_glue.py): the evicted blocks are
copied to G2 before their slots can be reused, and the allocation may have to wait for that.
"""

from __future__ import annotations

from engined.core.block_moves import Deref, Promote, Use
from engined.core.hashing import hash_of_key
from engined.core.kv_cache import DestinationReservation
from engined.core.kv_event_log import KvEventLog
from engined.core.kv_registry import BlockRegistry
from engined.core.lineage_pool import BlockPool
from engined.core.offload.g1_glue import G1Glue
from engined.core.offload.tier_engine import TierEngine
from engined.core.prefix_hit import PrefillCost, PrefixHit
from engined.core.sequence import BlockMove, Sequence
from engined.core.types import KvEvent, OffloadWait


class KvManager:
    """Block ownership of one rank: partial blocks, full-block handles, queued events."""

    __slots__ = (
        "active_partial",
        "block_size",
        "holders",
        "log",
        "offload",
        "pool",
        "prefix_hit",
        "registered",
        "registry",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dp_rank: int,
        publish: bool,
        prefix_hit: PrefixHit,
        tiers: TierEngine | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.prefix_hit = prefix_hit
        self.block_size = block_size
        self.log = KvEventLog(block_size, dp_rank=dp_rank, publish=publish)
        self.registry = BlockRegistry(num_blocks, self.pool.registered)
        # The registry's maps, bound here for the hot paths.
        self.active_partial = self.registry.active_partial
        self.holders = self.registry.holders
        # The pool's lineage key -> slot map, read directly on the hot paths.
        self.registered = self.pool.registered
        self.offload: G1Glue | None = None
        if tiers is not None:
            self.attach_tiers(tiers)

    def attach_tiers(self, engine: TierEngine) -> None:
        """Give this pool lower tiers. Blocks published before keep no router metadata."""
        self.offload = G1Glue(engine, self.pool, self.log)

    def take_offload_wait(self) -> OffloadWait | None:
        """The offload the last failed allocation must wait for (None: it simply failed)."""
        return self.offload.take_wait() if self.offload is not None else None

    def refresh_offload_wait(self, wait: OffloadWait) -> OffloadWait | None:
        """`wait` refreshed while its offload is in flight; None once it ended."""
        return self.offload.refresh(wait) if self.offload is not None else None

    def _exhausted(self) -> bool:
        """An allocation failed for want of blocks: it waits on no offload. Returns False."""
        if self.offload is not None:
            self.offload.wait = None
        return False

    # --- queries ------------------------------------------------------------------------

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can hold: all of the mocker's pool."""
        return self.pool.num_blocks

    def num_active_blocks(self) -> int:
        return self.pool.num_active

    def num_inactive_blocks(self) -> int:
        return self.pool.num_inactive

    def take_events(self) -> list[KvEvent]:
        return self.log.take()

    def prefill_cost(self, seq: Sequence) -> PrefillCost:
        """The cost under the core's prefix-hit rule (engined/core/prefix_hit.py)."""
        return self.prefix_hit.cost(seq, *self.registry.resident_prefix(seq))

    def active_block_ids(self, seq: Sequence) -> list[int]:
        return self.registry.active_block_ids(seq)

    # --- moves --------------------------------------------------------------------------

    def apply(self, move: BlockMove, now_ms: float) -> bool:
        """Apply one move; False only when a Use cannot get its fresh blocks (nothing changed).

        `now_ms` is the time of the engine call applying it: with offload tiers, the blocks a
        Use evicts start their offload then (`G1Glue.settle`).
        """
        if type(move) is Use:
            return self.use(move, now_ms)
        if type(move) is Deref:
            self.deref(move)
        else:
            assert type(move) is Promote
            self.promote(move)
        return True

    def apply_all(self, moves: list[BlockMove], now_ms: float) -> bool:
        """Apply in order, stopping at the first failure (earlier moves stay applied)."""
        # NOTE: a loop, not all() over a generator: mypyc compiles generators to objects.
        for move in moves:  # noqa: SIM110
            if not self.apply(move, now_ms):
                return False
        return True

    def free_all(self, moves: list[BlockMove]) -> None:
        """Apply a request's freeing moves (`Sequence.free_moves`: Derefs). Freeing evicts
        nothing, so it needs no time and cannot fail."""
        for move in moves:
            assert type(move) is Deref, "freeing moves are Derefs on the mocker's pool"
            self.deref(move)

    def use(self, move: Use, now_ms: float, reservation: list[int] | None = None) -> bool:
        if not move.hashes and reservation is None and self.offload is None:
            return self.use_partial(move.partial)
        pool = self.pool
        # Existing blocks: >= 0 block id, with a handle taken now; -1 = fresh. Matched
        # inactive blocks are revived now and released again (with fresh ticks) if the
        # allocation fails, as upstream does; a block requests hold just gives its handle back.
        prepared: list[int] = []
        matched: list[int] = []
        fresh = 0
        for key in move.keys:
            slot = pool.match(key)
            if slot is None:
                prepared.append(-1)
                fresh += 1
            else:
                prepared.append(slot)
                matched.append(slot)
        partial = move.partial
        fresh_partial = partial is not None and partial not in self.active_partial
        fresh += fresh_partial
        evicted: list[int] = []
        if reservation is not None:
            if len(reservation) < fresh:
                for block_id in matched:
                    pool.release(block_id)
                return False
            slots = [reservation.pop() for _ in range(fresh)]
        else:
            got = self._allocate(fresh, matched, now_ms)
            if got is None:
                return False
            slots, evicted = got
        self._commit_use(move, prepared, slots)
        if fresh_partial:
            assert partial is not None
            self.active_partial[partial] = slots[-1]
        if evicted:
            self._evictions(evicted)
        return True

    def _allocate(
        self, count: int, pinned: list[int], now_ms: float
    ) -> tuple[list[int], list[int]] | None:
        """`count` mutable slots and the keys they evicted whose Removed events the caller
        publishes (after its own Stored ones); with tiers the glue has offered those to G2
        from `now_ms` and published them. None when the slots cannot be had: then the
        `pinned` handles the caller took are given back."""
        got = self.pool.allocate(count)
        if got is not None:
            slots, evicted = got
            if not evicted or self.offload is None:
                return got
            settled = self.offload.settle(slots, evicted, now_ms)
            if settled is not None:
                return settled, []
        else:
            self._exhausted()
        for block_id in pinned:
            self.pool.release(block_id)
        return None

    def use_partial(self, partial: int | None) -> bool:
        """`use` of a Use without full blocks: the block a decode token opens (its partial).

        The same effects as the general path, without its per-block bookkeeping: one slot,
        free or evicted, and the Removed events of what was evicted.
        """
        if partial is None or partial in self.active_partial:
            return True
        slot, evicted = self.pool.allocate_one()
        if slot < 0:
            return self._exhausted()
        self.active_partial[partial] = slot
        if evicted >= 0:
            self._evictions([evicted])
        return True

    def _commit_use(self, move: Use, prepared: list[int], slots: list[int]) -> None:
        pool = self.pool
        holders = self.holders
        plain = self.offload is None
        meta_parent = move.parent
        run_parent = meta_parent
        run: list[int] = []
        j = 0
        for i, h in enumerate(move.hashes):
            block_id = prepared[i]
            if block_id >= 0:
                if run:
                    self.store_run(move, run, run_parent)
                    run = []
                holders[block_id] += 1
                meta_parent = run_parent = h
                continue
            if not run:
                run_parent = meta_parent
            slot = slots[j]
            j += 1
            key = move.keys[i]
            if plain:
                # `use` found the key unregistered, and a plain allocation registers nothing.
                pool.register_new(slot, key, move.parent_key(i))
            else:
                got = pool.register(slot, key, move.parent_key(i))
                assert got == slot, "fresh block must be a new registration"
            holders[slot] = 1
            run.append(i)
            meta_parent = h
        if run:
            self.store_run(move, run, run_parent)

    def store_run(self, move: Use, run: list[int], parent: int | None) -> None:
        event = self.log.stored_run(move, run, parent)
        if event is not None and self.offload is not None:
            self.offload.remember(move.keys[run[0] : run[-1] + 1], event)

    def deref(self, move: Deref) -> None:
        pool = self.pool
        if move.partial is not None:
            pool.release_mutable(self.active_partial.pop(move.partial))
        registered = self.registered
        holders = self.holders
        for key in move.keys:
            block_id = registered[key]
            holders[block_id] -= 1
            pool.release(block_id)

    def promote(self, move: Promote) -> None:
        slot = self.active_partial.pop(move.partial)
        if self._commit_full(slot, move.key, move.parent_key):
            event = self.log.stored_promoted(move)
            if event is not None and self.offload is not None:
                self.offload.remember([move.key], event)

    def _commit_full(self, slot: int, key: int, parent_key: int | None) -> bool:
        """Make a filled slot the full block `key`; False when an identical block already
        existed (then the slot goes back and the request holds that block)."""
        pool = self.pool
        # A handle on the registered block, held by requests or not (match revives it).
        block_id = pool.match(key)
        if block_id is None:
            pool.register_new(slot, key, parent_key)
            self.holders[slot] = 1
            return True
        pool.release_mutable(slot)
        self.holders[block_id] += 1
        return False

    # --- speculative decode reservations ------------------------------------------------

    def reserve_slots(self, count: int, now_ms: float) -> list[int] | None:
        """Mutable slots set aside for a pass's MTP bursts (the pass at `now_ms`); evictions
        are published now."""
        got = self._allocate(count, [], now_ms)
        if got is None:
            return None
        slots, evicted = got
        if evicted:
            self._evictions(evicted)
        return slots

    def release_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self.pool.release_mutable(slot)

    # --- destinations -------------------------------------------------------------------

    def reserve_destination(self, seq: Sequence, now_ms: float) -> DestinationReservation | None:
        """Pin the cached prompt prefix and reserve fresh slots for the rest; no Stored yet.
        An offload this evicts starts at `now_ms`."""
        use = seq.prepare_allocation(seq.num_input_tokens)
        if use is None:
            return DestinationReservation([], [], None)
        pool = self.pool
        prefix: list[int] = []
        keys = use.keys
        if self.prefix_hit.recompute_last:
            # The blocks beyond the hit are transferred like missing ones (vLLM's decode side
            # asks the connector for everything after its own capped hit); activation then
            # finds the resident copy and publishes nothing for it.
            resident = self.registry.resident_prefix(seq)[0]
            keys = keys[: self.prefix_hit.hit_blocks(resident, seq)]
        for key in keys:
            # Pinned: a handle, whether requests hold the block or it was inactive.
            block_id = pool.match(key)
            if block_id is None:
                break
            prefix.append(block_id)
        got = self._allocate(use.num_blocks - len(prefix), prefix, now_ms)
        if got is None:
            return None
        slots, evicted = got
        if evicted:
            self._evictions(evicted)
        return DestinationReservation(prefix, slots, use)

    def cancel_destination(self, res: DestinationReservation) -> None:
        for block_id in res.prefix:
            self.pool.release(block_id)
        self.release_slots(res.slots)

    def activate_destination(self, res: DestinationReservation) -> None:
        """Commit a reservation as the sequence's blocks and publish the transferred ones."""
        use = res.use
        if use is None:
            return
        holders = self.holders
        n_prefix = len(res.prefix)
        meta_parent = use.parent
        run_parent = meta_parent
        run: list[int] = []
        slots = iter(res.slots)
        for i, h in enumerate(use.hashes):
            if i < n_prefix:
                # Pinned at reservation: the handle is taken, the request now holds it.
                holders[res.prefix[i]] += 1
                meta_parent = h
                continue
            if self._commit_full(next(slots), use.keys[i], use.parent_key(i)):
                if not run:
                    run_parent = meta_parent
                run.append(i)
            elif run:
                self.store_run(use, run, run_parent)
                run = []
            meta_parent = h
        if run:
            self.store_run(use, run, run_parent)
        if use.partial is not None:
            self.active_partial[use.partial] = next(slots)

    # --- eviction and reset -------------------------------------------------------------

    def _evictions(self, keys: list[int]) -> None:
        self.log.removed([hash_of_key(key) for key in keys])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache does.

        Like vLLM it refuses while any block is in use: the router would be told to drop
        blocks that are still held, and their later removal would name unknown blocks.
        """
        if self.pool.num_active:
            return False
        keys = self.pool.clear_inactive()
        if self.offload is not None:
            self.offload.forget(keys)
        self.log.cleared()
        return True
