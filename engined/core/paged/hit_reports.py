"""vLLM's `kv_cache_report_mode` "full": a request's prefix hit, published again.

vLLM publishes `BlockStored` only for blocks it newly caches, so a router mirroring the
cache from KV events never hears that a block it dropped (or never saw) is still there and
being reused. A request whose `SamplingParams.extra_args` says `kv_cache_report_mode:
"full"` makes vLLM 0.33's `KVCacheManager.get_computed_blocks` also publish the blocks it
hits (`BlockPool.emit_cached_block_events`): one `BlockStored` of the whole hit from block 0
(no parent), with each block's token ids, extra keys and, under lookahead hashes, the token
after it, each time the scheduler looks the request's hit up (an admission that then fails
for room publishes it again at the next attempt, as vLLM does).
"""

from __future__ import annotations

from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.sequence import Sequence
from engined.core.vllm_hashing import block_extra_keys, event_extra_keys


def store_hit_again(kv: PagedKvManager, seq: Sequence, hit: list[int]) -> None:
    """Publish `hit`, the cached blocks `seq` starts with, as one Stored."""
    bs = kv.block_size
    n = len(hit)
    tokens = seq.tokens
    lora = seq.lora
    salt = seq.cache_salt
    extra_keys: list[tuple[str, ...] | None] | None = None
    if lora is not None or salt is not None:
        extra_keys = [
            event_extra_keys(block_extra_keys(lora, salt if i == 0 else None)) for i in range(n)
        ]
    lookahead = [[tokens[(i + 1) * bs]] for i in range(n)] if kv.lookahead else None
    event_hash = kv.pool.event_hash
    kv.log.stored_blocks(
        None,
        [event_hash(block) for block in hit],
        seq.local[:n],
        tokens[: n * bs].tolist(),
        extra_keys=extra_keys,
        lora_id=None if lora is None else lora.lora_int_id,
        lora_name=None if lora is None else lora.lora_name,
        lookahead_token_ids=lookahead,
    )
