"""What an idle vLLM-semantics block pool costs per block (issue 26: 64 simulated workers of
16384 blocks each in one daemon must stay within twice the mocker's memory).

Links and handle counts are 4-byte machine ints and the cached-block key list 8 bytes a
block; the hashes of cached blocks live in a dict, so an idle pool holds none of them.
"""

from __future__ import annotations

import gc
import tracemalloc

from engined.core.kv_event_log import KvEventLog
from engined.core.paged.block_pool import PagedBlockPool
from engined.core.vllm_hashing import event_block_hash_int

NUM_BLOCKS = 16384


def test_an_idle_pool_costs_at_most_21_bytes_a_block() -> None:
    log = KvEventLog(16, dp_rank=0, publish=True)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = PagedBlockPool(NUM_BLOCKS, caching=True, log=log)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert pool.num_free == NUM_BLOCKS - 1
    # 3 arrays of 4 bytes and a list of 8 bytes per block: 20 bytes, plus fixed overhead.
    assert used <= 21 * NUM_BLOCKS


def test_cached_hashes_leave_with_their_blocks() -> None:
    log = KvEventLog(16, dp_rank=0, publish=True)
    pool = PagedBlockPool(8, caching=True, log=log)
    blocks = pool.get_new_blocks(2, 0.0)
    pool.cache_run(
        blocks,
        [11, 12],
        [b"a" * 32, b"b" * 32],
        [event_block_hash_int(b"a" * 32), event_block_hash_int(b"b" * 32)],
    )
    assert pool.event_hash(blocks[1]) == int.from_bytes(b"b" * 8, "big")
    pool.free_blocks(reversed(blocks))
    # Every other free block is taken first; then the two cached ones are evicted, tail first.
    pool.get_new_blocks(pool.num_free, 0.0)
    assert pool.vllm_hash_of == {}
    assert pool.event_hash_of == {}
    assert pool.cached == {}
