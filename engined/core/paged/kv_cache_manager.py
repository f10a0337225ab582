"""vLLM 0.33's KV cache manager for one full-attention group: block tables per request.

What a vLLM scheduler asks of its `KVCacheManager`, with vLLM's rules
(vllm/v1/core/kv_cache_manager.py, single_type_kv_cache_manager.py):

* `get_computed_blocks`: the longest run of cached blocks from the start of the request's
  known tokens, at most `num_tokens - 1` tokens long (the last token is recomputed for its
  logits). With MTP (`lookahead`) vLLM's hashes are its lookahead block hashes: each block's
  covers the token after it too (extra keys `(keys, next token)`, the token published as
  `lookahead_token_ids`), so a block is hashed, and can be cached, only once that token is
  known; the pool keys blocks by the same pair (`_lookahead_keys`).
* `allocate_slots`: slots for the tokens scheduled now, counted whole blocks, or nothing at
  all when the free queue cannot supply them (hit blocks that are free count against it). The
  blocks whose every token is scheduled are cached at once, one `BlockStored` per call,
  after the `BlockRemoved` of whatever the allocation evicted.
* `free`: a request's blocks go back tail first.

It also answers the engine's shared KV interface (`free_all` of `Release` moves, the
gauges, the event log), so the preempter, the finisher and the token emitter work over it
unchanged. Offload tiers stay on the mocker pool (README "Faithfulness"): here `offload` is
always None, and the `now_ms` an allocation takes only dates the residency samples
(`--kv-cache-metrics`, engined/core/paged/residency.py).
"""

from __future__ import annotations

from engined.core.hashing import chain_hash
from engined.core.kv_cache import DestinationReservation
from engined.core.kv_event_log import KvEventLog
from engined.core.offload.g1_glue import G1Glue
from engined.core.paged.block_pool import PagedBlockPool
from engined.core.paged.residency import BlockResidency
from engined.core.policy import context_length
from engined.core.sequence import BlockMove, Release, Sequence
from engined.core.types import KvEvent, OffloadWait
from engined.core.vllm_hashing import (
    BlockHasher,
    block_extra_keys,
    event_extra_keys,
    native_chain,
)


class PagedKvManager:
    __slots__ = (
        "_chain",
        "_drop_last_hit",
        "_hasher",
        "_none_hash",
        "_num_cached",
        "_reserved",
        "_tables",
        "block_size",
        "caching",
        "log",
        "lookahead",
        "max_model_len",
        "pool",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dp_rank: int,
        caching: bool,
        max_model_len: int | None,
        hasher: BlockHasher,
        residency: BlockResidency | None = None,
        lookahead: bool = False,
        drop_last_hit: bool = False,
    ) -> None:
        """`max_model_len` is the configured one (None: unset); the pool caps it. `residency`
        samples the pool's blocks (`kv_cache_metrics`); `lookahead`, `drop_last_hit`: vLLM's
        lookahead block hashes (MTP), its EAGLE trailing-block drop of a prefix hit."""
        self.block_size = block_size
        self.caching = caching
        self._hasher = hasher
        self._none_hash = hasher.none_hash
        # vLLM's default algorithm, chained (in C when compiled); None: the others, by block.
        self._chain = native_chain(hasher.algo, block_size)
        self.lookahead = lookahead and caching
        self._drop_last_hit = drop_last_hit
        self.log = KvEventLog(block_size, dp_rank=dp_rank, publish=caching)
        self.pool = PagedBlockPool(num_blocks, caching=caching, log=self.log, residency=residency)
        self.max_model_len = context_length(self.usable_blocks, block_size, max_model_len)
        # Each request's block table, and how many of its leading blocks are cached.
        self._tables: dict[Sequence, list[int]] = {}
        self._num_cached: dict[Sequence, int] = {}
        # Each reserved P/D destination's sequence, until it is activated or cancelled.
        self._reserved: dict[DestinationReservation, Sequence] = {}

    @property
    def offload(self) -> G1Glue | None:
        """No offload tiers on the vLLM pool (they run on the mocker's)."""
        return None

    # --- vLLM's KVCacheManager ----------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting request starts with (vLLM's prefix hit)."""
        if not self.caching:
            return []
        n = (len(seq.tokens) - 1) // self.block_size
        cached = self.pool.cached
        hit: list[int] = []
        keys = self._lookahead_keys(seq, 0, n) if self.lookahead else seq.keys[:n]
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            hit.append(block)
        if self._drop_last_hit and hit:
            hit.pop()
        return hit

    def allocate_slots(
        self,
        seq: Sequence,
        num_computed: int,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        cache: bool = True,
        full_sequence_must_fit: bool = False,
        *,
        now_ms: float,
        watermark_blocks: int = 0,
        lookahead: int = 0,
    ) -> bool:
        """Slots for `num_new_tokens` after `num_computed` (plus the hit, for a waiting
        request) and `lookahead` more (MTP's draft slots, vLLM's `num_lookahead_tokens`);
        False, having changed nothing, when the free queue is too short, or, with
        `full_sequence_must_fit` (vLLM's admission gate), when it could not hold the whole
        known sequence; either must leave `watermark_blocks` free (vLLM's, for admissions).
        Only known tokens are cached, never draft ones."""
        bs = self.block_size
        pool = self.pool
        hit = new_computed_blocks or []
        computed = min(num_computed + len(hit) * bs, self.max_model_len)
        need = min(computed + num_new_tokens + lookahead, self.max_model_len)
        table = self._tables.get(seq)
        held = len(table) if table is not None else 0
        refs = pool.refs
        evictable = 0
        for block in hit:
            if refs[block] == 0:
                evictable += 1
        if full_sequence_must_fit:
            whole = -(-min(len(seq.tokens), self.max_model_len) // bs)
            if max(whole - held - len(hit), 0) + evictable + watermark_blocks > pool.num_free:
                return False
        if max(-(-need // bs) - held - len(hit), 0) + evictable + watermark_blocks > pool.num_free:
            return False
        if table is None:
            table = self._tables[seq] = []
        if hit:
            pool.touch(hit, now_ms)
            table.extend(hit)
            self._num_cached[seq] = len(table)
        fresh = -(-need // bs) - len(table)
        if fresh > 0:
            table.extend(pool.get_new_blocks(fresh, now_ms))
        if need > seq.num_allocated_tokens:
            seq.num_allocated_tokens = need
        if cache and self.caching:
            self._cache_blocks(seq, table, min(computed + num_new_tokens, len(seq.tokens)))
        return True

    def append_slot(self, seq: Sequence, length: int, now_ms: float) -> bool:
        """`allocate_slots(seq, length - 1, 1)` of a running request: a slot for its token
        `length`, in a new block when the held ones are full (False, with nothing changed,
        when none is free), and the block that token fills cached."""
        table = self._tables[seq]
        bs = self.block_size
        pool = self.pool
        if length > len(table) * bs:
            if not pool.num_free:
                return False
            table.append(pool.get_new_block(now_ms))
        if length > seq.num_allocated_tokens:
            seq.num_allocated_tokens = length
        if self.caching and length % bs == 0:
            pos = length // bs - 1
            if (
                pos
                and not self.lookahead
                and self._num_cached.get(seq) == pos
                and len(seq.hashes) > pos
                and seq.lora is None
            ):
                self._cache_block(seq, table, pos)
            else:
                self._cache_blocks(seq, table, length)
        return True

    def _cache_block(self, seq: Sequence, table: list[int], pos: int) -> None:
        """`_cache_blocks` of the one block a decode step fills, `pos` (not the first: no
        salt), when the blocks before it are cached and it has no extra keys (no LoRA): a
        sixth of a steady pass's cost was the general path's bookkeeping around the hash."""
        bs = self.block_size
        pool = self.pool
        parent_block = table[pos - 1]
        parent = pool.vllm_hash_of[parent_block]
        token_ids = seq.tokens[pos * bs : (pos + 1) * bs].tolist()
        chain = self._chain
        if chain is not None:
            h = chain(parent, token_ids, 0, 1, bs)[0]
        else:
            h = self._hasher.block_hash(parent, token_ids, None)
        ext = int.from_bytes(h[-8:], "big")
        pool.cache(table[pos], seq.keys[pos], h, ext)
        self._num_cached[seq] = pos + 1
        self.log.stored_one(pool.event_hash(parent_block), ext, seq.local[pos], token_ids)

    def _cache_blocks(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Cache the blocks whose every token is scheduled: vLLM hashes each chained to the
        previous block's hash, with its extra keys (a LoRA request's on every block, a salt
        on the first: `block_extra_keys`), and publishes them as one Stored, with the
        adapter's id and name for a LoRA request."""
        bs = self.block_size
        done = self._num_cached.get(seq, 0)
        full = min(num_tokens, len(seq.hashes) * bs) // bs
        if self.lookahead:
            full = min(full, (len(seq.tokens) - 1) // bs)
        if done >= full:
            return
        if self.lookahead:
            self._cache_lookahead(seq, table, done, full)
            return
        pool = self.pool
        parent = pool.vllm_hash_of[table[done - 1]] if done else self._none_hash
        lora = seq.lora
        # Only the first block has the salt.
        salt = None if done else seq.cache_salt
        # One list of the run's tokens serves the hashes and the event.
        token_ids = seq.tokens[done * bs : full * bs].tolist()
        hashes: list[bytes] = []
        # The leading blocks with extra keys, one by one (the chains cover no extra keys).
        keyed = full - done if lora is not None else int(salt is not None)
        event_keys: list[tuple[str, ...] | None] | None = None
        if keyed:
            block_hash = self._hasher.block_hash
            keys = block_extra_keys(lora, salt)
            later = block_extra_keys(lora, None)
            # Untagged in events, as vLLM's `to_event_extra_keys` publishes them.
            event_keys = [event_extra_keys(keys)]
            event_keys += [event_extra_keys(later)] * (keyed - 1) + [None] * (full - done - keyed)
            for start in range(0, keyed * bs, bs):
                parent = block_hash(parent, token_ids[start : start + bs], keys)
                hashes.append(parent)
                keys = later
        chain = self._chain
        if chain is not None:
            hashes.extend(chain(parent, token_ids, keyed * bs, full - done - keyed, bs))
        else:
            block_hash = self._hasher.block_hash
            for start in range(keyed * bs, len(token_ids), bs):
                parent = block_hash(parent, token_ids[start : start + bs], None)
                hashes.append(parent)
        stored = [int.from_bytes(h[-8:], "big") for h in hashes]
        pool.cache_run(table[done:full], seq.keys[done:full], hashes, stored)
        self._num_cached[seq] = full
        self.log.stored_blocks(
            pool.event_hash(table[done - 1]) if done else None,
            stored,
            seq.local[done:full],
            token_ids,
            extra_keys=event_keys,
            lora_id=None if lora is None else lora.lora_int_id,
            lora_name=None if lora is None else lora.lora_name,
        )

    def _lookahead_keys(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The pool keys of blocks `start` to `end` under lookahead hashes: each block's
        key with the token after it."""
        tokens = seq.tokens
        bs = self.block_size
        keys = seq.keys
        return [chain_hash(keys[i], tokens[(i + 1) * bs]) for i in range(start, end)]

    def _cache_lookahead(self, seq: Sequence, table: list[int], done: int, full: int) -> None:
        """`_cache_blocks` of blocks `done` to `full` under lookahead hashes: each hashed
        one by one with its extra keys and the token after it (the chains cover neither)."""
        bs = self.block_size
        pool = self.pool
        parent = pool.vllm_hash_of[table[done - 1]] if done else self._none_hash
        lora = seq.lora
        tokens = seq.tokens
        token_ids = tokens[done * bs : full * bs].tolist()
        block_hash = self._hasher.block_hash
        hashes: list[bytes] = []
        event_keys: list[tuple[str, ...] | None] = []
        lookahead_ids: list[list[int]] = []
        for i in range(done, full):
            keys = block_extra_keys(lora, seq.cache_salt if i == 0 else None)
            following = tokens[(i + 1) * bs]
            start = (i - done) * bs
            parent = block_hash(parent, token_ids[start : start + bs], (keys, following))
            hashes.append(parent)
            event_keys.append(event_extra_keys(keys))
            lookahead_ids.append([following])
        stored = [int.from_bytes(h[-8:], "big") for h in hashes]
        pool.cache_run(table[done:full], self._lookahead_keys(seq, done, full), hashes, stored)
        self._num_cached[seq] = full
        self.log.stored_blocks(
            pool.event_hash(table[done - 1]) if done else None,
            stored,
            seq.local[done:full],
            token_ids,
            extra_keys=event_keys if any(k is not None for k in event_keys) else None,
            lora_id=None if lora is None else lora.lora_int_id,
            lora_name=None if lora is None else lora.lora_name,
            lookahead_token_ids=lookahead_ids,
        )

    def cache_computed(self, seq: Sequence, num_tokens: int) -> None:
        """vLLM's `cache_blocks` after a sampled token arrives (async scheduling): cache the
        full blocks among the first `num_tokens`."""
        table = self._tables.get(seq)
        if table is not None and self.caching:
            self._cache_blocks(seq, table, num_tokens)

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq, None)
        self._num_cached.pop(seq, None)
        seq.num_allocated_tokens = 0
        if table:
            table.reverse()
            self.pool.free_blocks(table)

    def block_table(self, seq: Sequence) -> list[int]:
        return list(self._tables.get(seq, ()))

    # --- the engine's KV interface ------------------------------------------------------

    def apply_all(self, moves: list[BlockMove], now_ms: float) -> bool:
        self.free_all(moves)
        return True

    def free_all(self, moves: list[BlockMove]) -> None:
        for move in moves:
            assert type(move) is Release, "the vLLM pool frees whole requests only"
            self.free(move.seq)

    @staticmethod
    def usable_of(num_blocks: int) -> int:
        """Blocks requests can hold in a pool of `num_blocks`: all but vLLM's null block."""
        return num_blocks - 1

    @property
    def usable_blocks(self) -> int:
        return self.usable_of(self.pool.num_blocks)

    def num_active_blocks(self) -> int:
        return self.pool.num_used

    def num_inactive_blocks(self) -> int:
        return self.pool.num_cached_free

    def take_events(self) -> list[KvEvent]:
        return self.log.take()

    def take_offload_wait(self) -> OffloadWait | None:
        return None

    def refresh_offload_wait(self, wait: OffloadWait) -> OffloadWait | None:
        return None

    def active_block_ids(self, seq: Sequence) -> list[int]:
        return self.block_table(seq)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # --- P/D destinations ---------------------------------------------------------------

    def reserve_destination(self, seq: Sequence, now_ms: float) -> DestinationReservation | None:
        """Blocks for a prompt whose KV arrives by transfer: the local hit, touched, and
        fresh blocks for the rest, cached (published) only at activation, as vLLM's
        `allocate_slots(delay_cache_blocks=True)` does for a remote prefill."""
        hit = self.get_computed_blocks(seq)
        prompt_len = seq.num_input_tokens
        fresh = -(-prompt_len // self.block_size) - len(hit)
        if not self.allocate_slots(
            seq, 0, prompt_len - len(hit) * self.block_size, hit, False, now_ms=now_ms
        ):
            return None
        table = self._tables[seq]
        res = DestinationReservation(hit, table[len(hit) : len(hit) + fresh], None)
        self._reserved[res] = seq
        return res

    def activate_destination(self, res: DestinationReservation) -> None:
        seq = self._reserved.pop(res)
        if self.caching:
            self._cache_blocks(seq, self._tables[seq], seq.num_input_tokens)

    def cancel_destination(self, res: DestinationReservation) -> None:
        self.free(self._reserved.pop(res))
