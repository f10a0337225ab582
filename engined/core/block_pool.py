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

from collections import deque
from heapq import heappop, heappush
from typing import NamedTuple

_POS_SHIFT = 64


class _Node:
    """A lineage node: real (an inactive block) or a ghost kept for its children."""

    __slots__ = ("children", "parent", "real", "tick")

    def __init__(self, real: bool, tick: int) -> None:
        self.real = real
        self.tick = tick
        self.parent: int | None = None
        self.children = 0


class LineageIndex:
    """Inactive blocks as a forest keyed by lineage key, evicting leaves by insertion tick.

    Leaves wait as `(tick, key)` entries in two queues: a block that is a leaf when inserted
    has the newest tick, so those entries arrive in tick order and a FIFO holds them; a node
    that becomes a leaf again (its last child left) keeps its old tick, and those few wait in
    a heap. The victim is the older of the two heads. Entries go stale when a node gains a
    child or is resurrected, and are skipped when popped. Both are rebuilt when stale entries
    outnumber live nodes, so a long-running engine's queues stay proportional to its pool.
    """

    __slots__ = ("_fresh", "_heap", "_next_tick", "_nodes", "count")

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}
        self._fresh: deque[tuple[int, int]] = deque()
        self._heap: list[tuple[int, int]] = []
        self._next_tick = 0
        self.count = 0

    def insert(self, key: int, parent_key: int | None) -> None:
        nodes = self._nodes
        node = nodes.get(key)
        tick = self._next_tick
        self._next_tick = tick + 1
        if node is None:
            node = _Node(True, tick)
            nodes[key] = node
        else:
            assert not node.real, "Duplicate insertion detected!"
            node.real = True
            node.tick = tick
        self.count += 1
        if parent_key is not None and node.parent is None:
            parent = nodes.get(parent_key)
            if parent is None:
                parent = _Node(False, -1)
                nodes[parent_key] = parent
            node.parent = parent_key
            parent.children += 1
        if node.children == 0:
            self._fresh.append((tick, key))
            self._compact()

    def remove(self, key: int) -> None:
        """Take a block out of the inactive set (resurrected by a match, or evicted)."""
        self._remove(key, self._nodes[key])

    def _remove(self, key: int, node: _Node) -> None:
        nodes = self._nodes
        assert node.real, "removing a block that is not inactive"
        node.real = False
        node.tick = -1
        self.count -= 1
        while not node.real and node.children == 0:
            del nodes[key]
            parent_key = node.parent
            if parent_key is None:
                return
            parent = nodes[parent_key]
            parent.children -= 1
            if parent.real:
                if parent.children == 0:
                    heappush(self._heap, (parent.tick, parent_key))
                    self._compact()
                return
            key, node = parent_key, parent

    def pop_victim(self) -> int:
        """Evict the oldest inactive leaf and return its key."""
        fresh = self._fresh
        heap = self._heap
        nodes = self._nodes
        while fresh or heap:
            if heap and (not fresh or heap[0][0] < fresh[0][0]):
                tick, key = heappop(heap)
            else:
                tick, key = fresh.popleft()
            node = nodes.get(key)
            if node is not None and node.real and node.children == 0 and node.tick == tick:
                self._remove(key, node)
                return key
        raise AssertionError("inactive pool has no evictable leaf")

    def _compact(self) -> None:
        """Drop the stale entries once they outnumber the live nodes."""
        if len(self._fresh) + len(self._heap) > 2 * self.count + 64:
            leaves = [(n.tick, k) for k, n in self._nodes.items() if n.real and n.children == 0]
            leaves.sort()
            self._fresh = deque(leaves)
            self._heap = []


class Allocation(NamedTuple):
    """Mutable slots taken from the pool, and the lineage keys evicted to supply them."""

    slots: list[int]
    evicted: list[int]


# NOTE: tuple.__new__ builds a NamedTuple in C; allocation is on the decode path.
_new = tuple.__new__


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
            return _new(Allocation, ([], []))
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
        return _new(Allocation, (slots, evicted))

    def _evict_one(self) -> tuple[int, int]:
        """Unregister the eviction victim: its slot (now mutable) and its lineage key."""
        key = self.inactive.pop_victim()
        block_id = self.registered.pop(key)
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
        if refs[block_id] == 0:
            self.inactive.remove(key)
        refs[block_id] += 1
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
