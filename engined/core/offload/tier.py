"""One lower tier (G2 host or G3 disk): a block pool plus what its router events need.

The pool is the G1 `BlockPool` (canonical registration with the Reject policy, lineage
eviction), as upstream builds its G2/G3 `BlockManager`s. On top of it a tier keeps:

* `meta`: router metadata by lineage key. A registration publishes Stored only for keys
  with metadata, an eviction publishes Removed only for keys whose metadata it pops. This is
  upstream's G2 translation of kvbm `Create`/`Remove` lifecycle events, and it is why blocks
  seeded without metadata stay invisible to routers.
* `reserved`: capacity promised to accepted transfers not yet registered
  (upstream `CapacityReservations`); admission needs `available - reserved >= n`.
* parent keys of registered blocks, which lineage eviction needs and which a block carries
  with it when it is copied to another tier.

Events go to the engine's shared buffer in the order they happen.
"""

from __future__ import annotations

from engined.core.lineage_pool import BlockPool
from engined.core.offload.tier_values import BlockMeta, TierEvent, TierEventKind
from engined.core.types import Medium


class Tier:
    __slots__ = ("_events", "_parents", "medium", "meta", "pool", "reserved")

    def __init__(self, num_blocks: int, medium: Medium, events: list[TierEvent]) -> None:
        self.pool = BlockPool(num_blocks)
        self.medium = medium
        self.meta: dict[int, BlockMeta] = {}
        self.reserved = 0
        self._parents: dict[int, int | None] = {}
        self._events = events

    @property
    def available(self) -> int:
        """Upstream `available_blocks()`: free plus inactive (evictable) blocks."""
        return self.pool.num_available

    def try_reserve(self, count: int) -> bool:
        if count == 0:
            return True
        if self.reserved + count > self.pool.num_available:
            return False
        self.reserved += count
        return True

    def release_reservation(self, count: int) -> None:
        self.reserved = max(self.reserved - count, 0)

    def contains(self, key: int) -> bool:
        return self.pool.is_registered(key)

    def parent_of(self, key: int) -> int | None:
        return self._parents.get(key)

    def match(self, key: int) -> int | None:
        """Pin the block registered under `key` (one more handle); its id, or None."""
        return self.pool.match(key)

    def release(self, block_id: int) -> None:
        self.pool.release(block_id)

    def allocate(self, count: int) -> list[int] | None:
        """Mutable slots for incoming blocks, evicting inactive ones; None if it cannot."""
        got = self.pool.allocate(count)
        if got is None:
            return None
        slots, evicted = got
        for key in evicted:
            self._parents.pop(key, None)
            meta = self.meta.pop(key, None)
            if meta is not None:
                self._events.append(TierEvent(TierEventKind.REMOVED, self.medium, meta))
        return slots

    def register(
        self, slot: int, key: int, parent_key: int | None, meta: BlockMeta | None = None
    ) -> int:
        """Register a filled slot under `key`; returns a held handle on the canonical block.

        A new registration adopts `meta` when given (else keeps what the tier remembers for
        the key) and publishes Stored if there is any. A key already registered keeps its
        block and its metadata (the slot is freed) and publishes nothing, as kvbm's Reject
        policy does.
        """
        block_id = self.pool.register(slot, key, parent_key)
        if block_id == slot:
            self._parents[key] = parent_key
            if meta is not None:
                self.meta[key] = meta
            stored = self.meta.get(key)
            if stored is not None:
                self._events.append(TierEvent(TierEventKind.STORED, self.medium, stored))
        return block_id

    def seed(self, key: int, parent_key: int | None) -> None:
        """Place an inactive block with no metadata, as the seed tests' `seed_g2_blocks`.

        A key already present is left as it is.
        """
        if self.contains(key):
            return
        slots = self.allocate(1)
        if slots is None:
            raise RuntimeError(f"{self.medium.value} tier has no block to seed")
        self.release(self.register(slots[0], key, parent_key))
