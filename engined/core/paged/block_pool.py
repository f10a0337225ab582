"""vLLM 0.33's block pool: a null block, an LRU free queue, and a hash map that allows twins.

The observable rules (vllm/v1/core/lineage_pool.py), which routers and the parity harness see:

* Block 0 is the null block: never handed out, so `num_gpu_blocks - 1` blocks are usable.
* Free blocks wait in one queue, initially in id order. Allocation takes from the front and
  evicts what a taken block still caches, one `BlockRemoved` per block, in order. A freed
  block that caches nothing goes to the front (reused first); a cached one to the back, so
  the least recently freed cached block is evicted first. A request frees its blocks tail
  first, so a chain's tail is evicted before its head.
* A hit takes a block back out of the queue wherever it is (`touch`).
* Caching does not deduplicate: a block filled with content another block already caches is
  cached too (vLLM keeps block tables append-only), gets its own `BlockStored`, and later its
  own `BlockRemoved`. Lookups return the first block cached under a hash.

Blocks are ints; the free queue is a doubly linked list over them (O(1) removal from the
middle and insertion at either end), and a block's cache key is its lineage key
(engined/core/hashing.py), -1 when it caches nothing. With `kv_cache_metrics`, `residency`
samples blocks as vLLM's metrics collector does (engined/core/paged/residency.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from engined.core.kv_event_log import KvEventLog
from engined.core.paged.residency import BlockResidency

NULL_BLOCK = 0


class PagedBlockPool:
    __slots__ = (
        "_head",
        "_next",
        "_prev",
        "_tail",
        "_twins",
        "cached",
        "caching",
        "event_hash_of",
        "key_of",
        "log",
        "num_blocks",
        "num_cached_free",
        "num_free",
        "refs",
        "residency",
        "vllm_hash_of",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        caching: bool,
        log: KvEventLog,
        residency: BlockResidency | None = None,
    ) -> None:
        assert num_blocks >= 2, "the pool needs a null block and one usable block"
        self.num_blocks = num_blocks
        self.caching = caching
        self.log = log
        # The free queue as a doubly linked list over block ids, between two sentinels.
        # Links and handle counts are 32-bit machine ints (arrays), and what only cached
        # blocks have lives in a dict: lists would hold a slot per block from the start, and
        # a host simulating 64 ranks of 16384 blocks would pay for every one while idle.
        head = self._head = num_blocks
        tail = self._tail = num_blocks + 1
        self._next = array("i", range(1, num_blocks + 3))
        self._prev = array("i", range(-1, num_blocks + 1))
        self._next[head] = 1
        self._next[num_blocks - 1] = tail
        self._prev[1] = head
        self._prev[tail] = num_blocks - 1
        self.num_free = num_blocks - 1
        # Free blocks that still cache a prefix: hits that revive them, and eviction fodder.
        self.num_cached_free = 0
        self.refs = array("i", bytes(4 * num_blocks))
        self.refs[NULL_BLOCK] = 1
        self.key_of = [-1] * num_blocks
        # What a cached block is to the outside: vLLM's hash of it (the next block's parent);
        # KV events carry its `event_hash` (engined/core/vllm_hashing.py).
        self.vllm_hash_of: dict[int, bytes] = {}
        # NOTE: and that hash as events carry it, kept beside it: a cached block's event
        # hash is read once as a parent and once at its eviction, and converting the bytes
        # each time cost more than keeping the int its caller computed anyway.
        self.event_hash_of: dict[int, int] = {}
        # Lineage key -> the first block cached under it; later twins in `_twins`, in order.
        self.cached: dict[int, int] = {}
        self._twins: dict[int, list[int]] = {}
        self.residency = residency

    @property
    def num_used(self) -> int:
        """Blocks held by requests (the null block excluded)."""
        return self.num_blocks - 1 - self.num_free

    def _unlink(self, block: int) -> None:
        nxt = self._next
        prv = self._prev
        a = prv[block]
        b = nxt[block]
        nxt[a] = b
        prv[b] = a
        self.num_free -= 1
        if self.key_of[block] >= 0:
            self.num_cached_free -= 1

    def get_new_blocks(self, count: int, now_ms: float) -> list[int]:
        """`count` blocks from the front of the queue at `now_ms`, evicting what they cached
        (the time only dates the residency samples)."""
        assert count <= self.num_free, "allocation beyond the free blocks"
        refs = self.refs
        key_of = self.key_of
        nxt = self._next
        prv = self._prev
        head = self._head
        residency = self.residency
        # The front `count` blocks leave the queue together: one relink, not one per block.
        taken: list[int] = []
        evicted: list[int] = []
        block = head
        for _ in range(count):
            block = nxt[block]
            taken.append(block)
            refs[block] = 1
            if key_of[block] >= 0:
                evicted.append(self._evict(block))
            if residency is not None:
                residency.allocated(block, now_ms)
        rest = nxt[block]
        nxt[head] = rest
        prv[rest] = head
        self.num_free -= count
        if evicted:
            self.num_cached_free -= len(evicted)
            self.log.removed_each(evicted)
        return taken

    def get_new_block(self, now_ms: float) -> int:
        """`get_new_blocks(1, now_ms)[0]` without its lists: the block a decode step opens."""
        assert self.num_free, "allocation beyond the free blocks"
        nxt = self._next
        head = self._head
        block = nxt[head]
        rest = nxt[block]
        nxt[head] = rest
        self._prev[rest] = head
        self.num_free -= 1
        self.refs[block] = 1
        if self.key_of[block] >= 0:
            self.num_cached_free -= 1
            self.log.removed_one(self._evict(block))
        if self.residency is not None:
            self.residency.allocated(block, now_ms)
        return block

    def _evict(self, block: int) -> int:
        """Drop a cached block taken from the queue from the cache; its hash as events carry
        it, for its Removed."""
        key = self.key_of[block]
        self.key_of[block] = -1
        self._uncache(key, block)
        del self.vllm_hash_of[block]
        return self.event_hash_of.pop(block)

    def event_hash(self, block: int) -> int:
        """A cached block's hash as KV events carry it (`event_block_hash_int` of vLLM's)."""
        return self.event_hash_of[block]

    def _uncache(self, key: int, block: int) -> None:
        twins = self._twins.get(key)
        if twins is None:
            del self.cached[key]
            return
        if self.cached[key] == block:
            self.cached[key] = twins.pop(0)
        else:
            twins.remove(block)
        if not twins:
            del self._twins[key]

    def cache(self, block: int, key: int, vllm_hash: bytes, event_hash: int) -> None:
        """Cache a held block just filled, under `key` (a twin when another block has it);
        `event_hash` is `event_block_hash_int(vllm_hash)`."""
        self.key_of[block] = key
        self.vllm_hash_of[block] = vllm_hash
        self.event_hash_of[block] = event_hash
        if key in self.cached:
            self._twins.setdefault(key, []).append(block)
        else:
            self.cached[key] = block

    def cache_run(
        self, blocks: list[int], keys: list[int], vllm_hashes: list[bytes], event_hashes: list[int]
    ) -> None:
        """`cache` of each of `blocks` in turn (a request's run, filled together)."""
        key_of = self.key_of
        vllm_hash_of = self.vllm_hash_of
        event_hash_of = self.event_hash_of
        cached = self.cached
        for block, key, vllm_hash, event_hash in zip(
            blocks, keys, vllm_hashes, event_hashes, strict=True
        ):
            key_of[block] = key
            vllm_hash_of[block] = vllm_hash
            event_hash_of[block] = event_hash
            if key in cached:
                self._twins.setdefault(key, []).append(block)
            else:
                cached[key] = block

    def touch(self, blocks: list[int], now_ms: float) -> None:
        """Take a handle on hit blocks at `now_ms`, out of the free queue if they were free."""
        refs = self.refs
        residency = self.residency
        for block in blocks:
            if refs[block] == 0:
                self._unlink(block)
            refs[block] += 1
            if residency is not None:
                residency.touched(block, now_ms)

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """Drop a handle on each block; of those it frees, the first is evicted first."""
        refs = self.refs
        key_of = self.key_of
        caching = self.caching
        prv = self._prev
        # Cached blocks go to the back in the order freed, the others to the front in the
        # order freed: two runs, each linked in at its end once.
        back: list[int] = []
        front: list[int] = []
        for block in ordered:
            n = refs[block] - 1
            refs[block] = n
            if n:
                continue
            if caching and key_of[block] >= 0:
                back.append(block)
            else:
                front.append(block)
        if front:
            self._splice(self._head, front)
        if back:
            self._splice(prv[self._tail], back)
            self.num_cached_free += len(back)
        self.num_free += len(front) + len(back)

    def _splice(self, anchor: int, run: list[int]) -> None:
        """Link `run` into the queue after `anchor`, in order."""
        nxt = self._next
        prv = self._prev
        after = nxt[anchor]
        prev = anchor
        for block in run:
            nxt[prev] = block
            prv[block] = prev
            prev = block
        nxt[prev] = after
        prv[after] = prev

    def reset(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False while any is held."""
        if self.num_used:
            return False
        self.cached.clear()
        self._twins.clear()
        self.key_of = [-1] * self.num_blocks
        self.vllm_hash_of.clear()
        self.event_hash_of.clear()
        self.num_cached_free = 0
        if self.residency is not None:
            self.residency.reset()
        self.log.cleared()
        return True
