"""Token and block state of one request, and the block moves it asks the KV manager for.

This is Dynamo's `ActiveSequence`: the sequence knows which blocks it consists of (full blocks
by sequence hash, at most one trailing partial block by a private id) and how far its KV has
been allocated; it never touches the pool itself. It describes what must happen as `Use`,
`Deref` and `Promote` moves (engined/core/block_moves.py) that the KV manager applies, so a
failed allocation can be undone by the caller (`pop`) without the sequence knowing about
capacity. vLLM's pool takes a single `Release`, which names the sequence and so lives here.

Allocation is eager: the token that opens a new block immediately asks for that block (and
promotes the block it completed), exactly as mocker 1.3.0 does. Block counts observed by the
seed tests depend on it.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from engined.core.block_moves import Deref, Promote, Use
from engined.core.hashing import (
    array_block_hash,
    block_hashes,
    chain_hash,
    chain_root,
    lineage_key,
    parent_lineage_key,
)
from engined.core.named_tuples import new_tuple
from engined.core.stops import StopRule
from engined.core.token_stream import TokenBits
from engined.core.types import LoraRequest
from engined.core.vocab import Vocabulary


class Release:
    """Drop every block of `seq` at once, tail first (the vLLM path, engined/core/paged/).

    vLLM's pool keeps a block table per request, not blocks by lineage key: two requests may
    hold distinct blocks with one hash, so only the sequence itself names what it holds.
    """

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq


BlockMove = Use | Deref | Promote | Release


class SampledToken(NamedTuple):
    """A token the sequence just took, and the block moves it requires."""

    token: int
    moves: list[BlockMove]


# The arrays' methods themselves: compiled, `tokens.append(t)` looks the name up per call.
_append: Final = array.append
_tolist: Final = array.tolist


class Sequence:
    """Prompt plus generated tokens, cut into blocks, with allocation bookkeeping.

    `hashes[i]` identifies full block i (the sequence hash with prefix caching, a random u64
    without: then no two requests share a block, but a preempted request still finds its own
    blocks again). `keys[i]` is the block's lineage key in the pool: with caching `keys` is
    `hashes` itself (engined/core/hashing.py), and `parent_key` derives the lineage parents.

    Unplanned tokens come from `token_bits`, the request's own stream
    (engined/core/token_stream.py); `popped` is a token taken back by `pop`, the next one
    generated, so a failed allocation does not shift the stream. `stops` (None without stop
    ids) ends the request early, and `stop_reason` is then the stop id it generated; a
    `cache_salt` and a LoRA adapter (`lora`) root its block hashes (`root`; vLLM semantics
    only, whose hashes key them too: engined/core/paged/kv_cache_manager.py).
    """

    __slots__ = (
        "_next_partial_id",
        "_rng",
        "_vocab",
        "block_size",
        "cache_salt",
        "caching",
        "emit_token_ids",
        "generated",
        "hashes",
        "keys",
        "local",
        "lora",
        "max_output_tokens",
        "num_allocated_tokens",
        "num_input_tokens",
        "paged",
        "partial",
        "plain",
        "planned",
        "popped",
        "root",
        "stop_reason",
        "stops",
        "token_bits",
        "tokens",
    )

    def __init__(
        self,
        tokens: list[int],
        max_output_tokens: int,
        block_size: int,
        *,
        caching: bool,
        rng: random.Random,
        token_bits: TokenBits,
        next_partial_id: Callable[[], int],
        planned: list[int] | None = None,
        emit_token_ids: bool = True,
        vocab: Vocabulary | None = None,
        paged: bool = False,
        stops: StopRule | None = None,
        cache_salt: str | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        assert block_size >= 2, "invalid ActiveSequence"
        # vLLM semantics (engined/core/paged/): blocks are allocated by the scheduler, so a
        # sampled token asks for nothing, and freeing is one `Release`.
        self.paged = paged
        self.block_size = block_size
        self.tokens = array("I", tokens)
        self.num_input_tokens = len(tokens)
        self.max_output_tokens = max_output_tokens
        self.generated = 0
        self.num_allocated_tokens = 0
        self.caching = caching
        self.emit_token_ids = emit_token_ids and caching
        self.planned = planned
        self._rng = rng
        self.token_bits = token_bits
        self.popped: int | None = None
        self.stops = stops
        # Neither planned nor stopping early: each token is a draw that ends nothing early.
        self.plain = planned is None and stops is None
        self.stop_reason: int | None = None
        self.cache_salt = cache_salt
        self.lora = lora
        # The parent of the first block's hash (None: a base-model request without salt).
        self.root = chain_root(
            cache_salt, None if lora is None else (lora.lora_name, lora.lora_path)
        )
        # The core's shared range, so a vocabulary change reaches running requests.
        self._vocab = vocab
        self._next_partial_id = next_partial_id
        self.local: list[int]
        self.hashes: list[int]
        self.keys: list[int]
        if caching:
            self.local, self.hashes = block_hashes(self.tokens, block_size, self.root)
            self.keys = self.hashes
        else:
            getrandbits = rng.getrandbits
            self.local = []
            self.hashes = [getrandbits(64) for _ in range(len(tokens) // block_size)]
            self.keys = [lineage_key(pos, h) for pos, h in enumerate(self.hashes)]
        self.partial: int | None = next_partial_id() if len(tokens) % block_size else None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        """Unique blocks (full plus the trailing partial)."""
        return len(self.hashes) + (self.partial is not None)

    def parent_key(self, pos: int) -> int | None:
        """The lineage key of block `pos`'s parent (None for the first block)."""
        if self.caching:
            return self.hashes[pos - 1] if pos else None
        return parent_lineage_key(pos)

    def current_known_blocks(self) -> int:
        return -(-len(self.tokens) // self.block_size)

    def to_completion_blocks(self) -> int:
        return -(-(self.num_input_tokens + self.max_output_tokens) // self.block_size)

    def prepare_allocation(self, cumulative_tokens: int) -> Use | None:
        """The Use that extends the allocation to cover `cumulative_tokens`, or None.

        Pure: stable until `num_allocated_tokens` moves, so the caller may retry it after
        preempting.
        """
        bs = self.block_size
        n_full = len(self.hashes)
        total = n_full + (self.partial is not None)
        prev = min(-(-self.num_allocated_tokens // bs), total)
        target = min(-(-cumulative_tokens // bs), total)
        if target <= prev:
            return None
        end = min(target, n_full)
        hashes = self.hashes[prev:end]
        return Use(
            prev,
            hashes,
            hashes if self.caching else self.keys[prev:end],
            self.local[prev:end] if self.caching else None,
            self.partial if target > n_full else None,
            self.hashes[prev - 1] if prev > 0 else None,
            self.tokens if self.emit_token_ids else None,
        )

    def finished(self) -> bool:
        """It generated its last token: its `max_output_tokens`, or a stop id."""
        return self.generated >= self.max_output_tokens or self.stop_reason is not None

    def generate_token(self) -> SampledToken:
        """Sample the next token; returns it with the block moves it requires.

        On the terminal token (the last allowed, or a stop id) the moves end with the Deref
        or Release that frees the whole sequence.
        """
        assert self.generated < self.max_output_tokens, (
            "Cannot generate more tokens: reached max_output_tokens limit"
        )
        planned = self.planned
        popped = self.popped
        vocab = self._vocab
        stops = self.stops
        if planned is not None:
            token = planned[self.generated]
        elif popped is not None and (vocab is None or vocab.allows(popped)):
            token = popped
        elif stops is not None and self.generated < stops.min_tokens:
            token = stops.draw(vocab, self.token_bits)
        elif vocab is None:
            token = self.token_bits(32)
        else:
            token = vocab.next_token(self.token_bits)
        self.popped = None
        stopped = stops is not None and stops.stops_at(token, self.generated + 1)
        if stopped:
            self.stop_reason = token
        if self.paged:
            self.push_paged(token)
            last = stopped or self.generated == self.max_output_tokens
            return new_tuple(SampledToken, (token, [Release(self)] if last else []))
        moves = self._push(token)
        if stopped or self.generated == self.max_output_tokens:
            moves.append(self._free_for_tokens(len(self.tokens)))
        return new_tuple(SampledToken, (token, moves))

    def push_paged(self, token: Any) -> None:
        """Take `token` under vLLM semantics: a block's hash exists as soon as its last token
        does, as vLLM's request block hasher adds it (the scheduler caches full blocks)."""
        tokens = self.tokens
        _append(tokens, token)
        self.generated += 1
        bs = self.block_size
        if not self.caching or len(tokens) % bs:
            return
        pos = len(self.hashes)
        lh = array_block_hash(tokens[pos * bs : (pos + 1) * bs])
        self.local.append(lh)
        parent = self.hashes[-1] if pos else self.root
        self.hashes.append(lh if parent is None else chain_hash(parent, lh))

    def _push(self, token: int) -> list[BlockMove]:
        tokens = self.tokens
        if len(tokens) % self.block_size != 0:
            tokens.append(token)
            self.generated += 1
            return []
        promote = self.open_block(token)
        use = Use(len(self.hashes), [], [], None, self.partial, None, None)
        return [use] if promote is None else [promote, use]

    def open_block(self, token: Any) -> Promote | None:
        """Take `token` when it opens a new block (the length is a multiple of the block size).

        Returns the Promote of the block it completes (None when that block was already
        full, a prompt that ended on a boundary); the new block is `partial`, a fresh id the
        caller allocates (`_push` asks for it with a Use). `pop` undoes the token. `token`
        is typed Any so that, compiled, the drawn int is stored as it is, not unboxed first.
        """
        tokens = self.tokens
        _append(tokens, token)
        self.generated += 1
        partial = self.partial
        self.partial = self._next_partial_id()
        if partial is None:
            return None
        bs = self.block_size
        pos = len(self.hashes)
        parent = self.hashes[-1] if pos else None
        block = tokens[pos * bs : (pos + 1) * bs]
        if self.caching:
            lh: int | None = array_block_hash(block)
            assert lh is not None
            h = lh if parent is None else chain_hash(parent, lh)
            self.local.append(lh)
            # `keys` is `hashes`: the one append serves both.
            self.hashes.append(h)
            key = h
            parent_key = parent
        else:
            lh = None
            h = self._rng.getrandbits(64)
            key = lineage_key(pos, h)
            parent_key = parent_lineage_key(pos)
            self.hashes.append(h)
            self.keys.append(key)
        return Promote(
            partial,
            h,
            parent,
            lh,
            key,
            parent_key,
            _tolist(block) if self.emit_token_ids else None,
        )

    def pop(self) -> None:
        """Undo the last sampled token after its block could not be allocated.

        A promotion that already happened stays: the block it completed is full either way.
        The token is kept as `popped`, what the retry generates at the same position.
        """
        self.popped = self.tokens.pop()
        self.generated = max(self.generated - 1, 0)
        self.stop_reason = None
        if len(self.tokens) % self.block_size == 0:
            self.partial = None

    def _free_for_tokens(self, num_tokens: int) -> Deref:
        n = min(-(-num_tokens // self.block_size), self.num_blocks)
        n_full = len(self.hashes)
        return Deref(self.partial if n > n_full else None, self.keys[: min(n, n_full)][::-1])

    def free_moves(self) -> list[BlockMove]:
        """The Deref releasing every allocated block (empty when nothing is allocated)."""
        if self.num_allocated_tokens == 0:
            return []
        if self.paged:
            return [Release(self)]
        return [self._free_for_tokens(self.num_allocated_tokens)]

    def reset_with_moves(self) -> list[BlockMove]:
        """Release the allocation for preemption; generated tokens are kept for recompute."""
        moves = self.free_moves()
        self.num_allocated_tokens = 0
        return moves
