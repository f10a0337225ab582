"""Physical KV blocks: free list, registry of matchable blocks, and lineage eviction.

A port of the observable behaviour of kvbm-logical's `BlockManager<G1>` as mocker 1.3.0
configures it (Reject duplication policy, Lineage inactive backend with the Tick policy):

* A slot is *free* (in the reset FIFO), *mutable* (held, unregistered: partial blocks and
  reservations), *primary* (registered and held by >= 1 handle) or *inactive* (registered,
  unheld, evictable). Registration is canonical: one block per lineage key.
* `num_active` is everything that is not free and not inactive. Routers and the seed tests
  read exactly this number.
* Eviction takes leaves of the inactive lineage forest only, oldest insertion tick first; a
  node that becomes a leaf again keeps its original tick. So a parent is never evicted while
  an inactive descendant survives, and Removed events never orphan a router's subtree.

Handles are not objects: a block's handle count lives in `_refs`, and callers hold block ids.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Final, NamedTuple

from engined.core.named_tuples import new_tuple

# NOTE: compiled, a Final name is a C static; an imported function is a dict lookup per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop


class LineageIndex:
    """Inactive blocks as a forest keyed by lineage key, evicting leaves by insertion tick.

    A real node's tick is its position in `_order`, which holds the key inserted at each
    tick (None once that node has left) and, beside it in `_parent_at`, the node's parent
    link. Nodes live in dicts and lists of ints: a node object and a tuple per insertion
    cost more in the garbage collections they trigger than in the bookkeeping itself.

    Eviction scans `_order` from `_head`. A node that still has children when the scan
    passes it keeps its tick and, once its last child leaves, waits in a heap of ticks; the
    victim is the older of the scan's next leaf and the heap's top. Entries go stale when a
    node gains a child or leaves, and are skipped. `_order` is rebuilt, renumbering ticks in
    order, once stale entries outnumber live nodes three to one, so a long-running engine's
    queues stay proportional to its pool. Every eviction leaves a stale entry and a rebuild
    rewrites every live tick, so rebuilding later costs less; the lists are small next to
    the dicts.
    """

    __slots__ = ("_children", "_ghost_parent", "_head", "_heap", "_order", "_parent_at", "_tick")

    def __init__(self) -> None:
        self._order: list[int | None] = []
        self._parent_at: list[int | None] = []
        self._head = 0
        self._heap: list[int] = []
        # The tick of every real node (an inactive block).
        self._tick: dict[int, int] = {}
        # The child count of every node that has children: a ghost is a key here that is
        # not in `_tick`.
        self._children: dict[int, int] = {}
        # The parent link a ghost kept from when it was real.
        self._ghost_parent: dict[int, int] = {}

    @property
    def count(self) -> int:
        return len(self._tick)

    def insert(self, key: int, parent_key: int | None) -> None:
        order = self._order
        ticks = self._tick
        live = len(ticks)
        ticks[key] = len(order)
        assert len(ticks) > live, "Duplicate insertion detected!"
        order.append(key)
        # NOTE: no dict.pop here nor below: compiled, it is a generic method call, and
        # costs more than a lookup and a del.
        ghosts = self._ghost_parent
        if ghosts and key in ghosts:
            self._parent_at.append(ghosts[key])
            del ghosts[key]
        else:
            self._parent_at.append(parent_key)
            if parent_key is not None:
                children = self._children
                children[parent_key] = children.get(parent_key, 0) + 1
        self._compact()

    def remove(self, key: int) -> None:
        """Take a block out of the inactive set (resurrected by a match)."""
        tick = self._tick.get(key)
        assert tick is not None, "removing a block that is not inactive"
        self._leave(tick, key)

    def _leave(self, tick: int, key: int) -> None:
        """The node inserted at `tick` is no longer an inactive block: with children it stays
        as a ghost keeping its parent link, without them its parent loses a child."""
        del self._tick[key]
        self._order[tick] = None
        parent_key = self._parent_at[tick]
        if parent_key is None:
            return
        if key in self._children:
            self._ghost_parent[key] = parent_key
        else:
            self._orphan(parent_key)

    def _orphan(self, key: int) -> None:
        """One child of `key` has gone: a real node left childless becomes a leaf again with
        its old tick, a ghost left childless goes too."""
        children = self._children
        while True:
            left = children[key] - 1
            if left:
                children[key] = left
                return
            del children[key]
            tick = self._tick.get(key)
            if tick is not None:
                _heappush(self._heap, tick)
                self._compact()
                return
            ghosts = self._ghost_parent
            parent_key = ghosts.get(key)
            if parent_key is None:
                return
            del ghosts[key]
            key = parent_key

    def pop_victim(self) -> int:
        """Evict the oldest inactive leaf and return its key."""
        order = self._order
        heap = self._heap
        children = self._children
        end = len(order)
        head = self._head
        while head < end:
            key = order[head]
            if key is not None and key not in children:
                break
            head += 1
        self._head = head
        while heap and (head == end or heap[0] < head):
            tick = _heappop(heap)
            key = order[tick]
            if key is not None and key not in children:
                self._leave(tick, key)
                return key
        if head == end:
            raise AssertionError("inactive pool has no evictable leaf")
        key = order[head]
        assert key is not None
        self._head = head + 1
        self._leave(head, key)
        return key

    def _compact(self) -> None:
        """Once stale entries outnumber live nodes three to one, drop them, renumbering the
        live nodes' ticks in their order."""
        if len(self._order) + len(self._heap) <= 4 * len(self._tick) + 64:
            return
        order: list[int | None] = []
        parent_at: list[int | None] = []
        old_parent_at = self._parent_at
        ticks = self._tick
        for tick, key in enumerate(self._order):
            if key is not None:
                ticks[key] = len(order)
                order.append(key)
                parent_at.append(old_parent_at[tick])
        self._order = order
        self._parent_at = parent_at
        self._head = 0
        self._heap = []


class Allocation(NamedTuple):
    """Mutable slots taken from the pool, and the lineage keys evicted to supply them."""

    slots: list[int]
    evicted: list[int]


class BlockPool:
    """`num_blocks` slots with canonical registration and lineage eviction."""

    __slots__ = ("_free", "_key_of", "_parent_of", "_refs", "inactive", "num_blocks", "registered")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Lineage key -> slot of every registered block (primary or inactive).
        self.registered: dict[int, int] = {}
        self._key_of: list[int] = [-1] * num_blocks
        self._parent_of: list[int | None] = [None] * num_blocks
        self._refs: list[int] = [0] * num_blocks
        self.inactive = LineageIndex()

    @property
    def num_inactive(self) -> int:
        return self.inactive.count

    @property
    def num_available(self) -> int:
        return len(self._free) + self.inactive.count

    @property
    def num_active(self) -> int:
        return self.num_blocks - len(self._free) - self.inactive.count

    def allocate(self, count: int) -> Allocation | None:
        """Take `count` mutable slots: free ones first, then evicted inactive ones.

        Returns the slot ids and the lineage keys evicted (in eviction order), or None with
        nothing changed when the pool cannot supply `count` slots.
        """
        if count == 0:
            return new_tuple(Allocation, ([], []))
        free = self._free
        if len(free) + self.inactive.count < count:
            return None
        take = min(count, len(free))
        slots = [free.popleft() for _ in range(take)]
        evicted: list[int] = []
        for _ in range(count - take):
            block_id, key = self._evict_one()
            slots.append(block_id)
            evicted.append(key)
        return new_tuple(Allocation, (slots, evicted))

    def _evict_one(self) -> tuple[int, int]:
        """Unregister the eviction victim: its slot (now mutable) and its lineage key."""
        key = self.inactive.pop_victim()
        registered = self.registered
        block_id = registered[key]
        del registered[key]
        self._key_of[block_id] = -1
        return block_id, key

    def allocate_one(self) -> tuple[int, int]:
        """`allocate(1)` without its lists: the slot (-1 with nothing changed when the pool
        is exhausted) and the lineage key evicted for it (-1 for a free slot)."""
        free = self._free
        if free:
            return free.popleft(), -1
        if not self.inactive.count:
            return -1, -1
        return self._evict_one()

    def register_new(self, slot: int, key: int, parent_key: int | None) -> None:
        """`register` of a key the caller just found unregistered (`match` gave None)."""
        self.registered[key] = slot
        self._key_of[slot] = key
        self._parent_of[slot] = parent_key
        self._refs[slot] = 1

    def register(self, slot: int, key: int, parent_key: int | None) -> int:
        """Register a filled mutable slot under `key`, returning the block that now holds it.

        Reject policy: if `key` is already registered the slot goes back to the free list and
        a new handle on the existing block is returned instead.
        """
        existing = self.match(key)
        if existing is not None:
            self._free.append(slot)
            return existing
        self.register_new(slot, key, parent_key)
        return slot

    def match(self, key: int) -> int | None:
        """A new handle on the block registered under `key`, resurrecting it if inactive."""
        block_id = self.registered.get(key)
        if block_id is None:
            return None
        refs = self._refs
        n = refs[block_id]
        if n == 0:
            self.inactive.remove(key)
        refs[block_id] = n + 1
        return block_id

    def is_registered(self, key: int) -> bool:
        return key in self.registered

    @property
    def num_registered(self) -> int:
        return len(self.registered)

    def parent_key_of(self, block_id: int) -> int | None:
        """The lineage parent of the block's last registration.

        Still valid for a slot `allocate` just took by evicting it (until the slot is
        registered again): the offload tiers copy an evicted block with its lineage.
        """
        return self._parent_of[block_id]

    def acquire(self, block_id: int) -> None:
        """One more handle on a block that is already held."""
        assert self._refs[block_id] > 0, "acquire on an unheld block"
        self._refs[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop one handle; the last one makes the block inactive (and evictable)."""
        refs = self._refs
        n = refs[block_id] - 1
        refs[block_id] = n
        if n == 0:
            self.inactive.insert(self._key_of[block_id], self._parent_of[block_id])

    def release_mutable(self, slot: int) -> None:
        """Return an unregistered slot to the back of the free list."""
        self._free.append(slot)

    def clear_inactive(self) -> list[int]:
        """Evict every inactive block (prefix-cache reset); returns their keys."""
        keys: list[int] = []
        while self.inactive.count:
            block_id, key = self._evict_one()
            self._free.append(block_id)
            keys.append(key)
        return keys
