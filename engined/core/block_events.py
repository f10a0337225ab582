"""The KV events a pass or a command publishes: what a router indexes, as vLLM's
`vllm/distributed/kv_events.py` names them (the wire encodes them in engined/wire).

Apart from types.py (which re-exports them) because they are the one part of the core's
values every KV consumer (the publishers, the replay ring, the reference indexer) reads.
"""

from __future__ import annotations

import enum

import msgspec


class Medium(enum.StrEnum):
    """Storage tier of a KV event, spelled as vLLM spells `medium`."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Blocks became matchable on this rank.

    `block_hashes` are sequence hashes (the router's block identity), `local_hashes` the
    per-block content hashes, `token_ids` the blocks' tokens flattened
    (`len(block_hashes) * block_size` ids). `parent_hash` is the sequence hash of the block
    before the first one, None at the root.
    """

    event_id: int
    dp_rank: int
    parent_hash: int | None
    block_hashes: list[int]
    local_hashes: list[int]
    token_ids: list[int]
    block_size: int
    medium: Medium = Medium.GPU
    extra_keys: list[tuple[str, ...] | None] | None = None  # per block as vLLM's, None: none
    # A LoRA request's blocks: vLLM's `lora_id` (the adapter's `lora_int_id`) and `lora_name`.
    lora_id: int | None = None
    lora_name: str | None = None
    # vLLM's lookahead block hashes (MTP with prefix caching): per block, the tokens after it
    # that its hash covers; None without.
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks were evicted from `medium` and can no longer be matched there."""

    event_id: int
    dp_rank: int
    block_hashes: list[int]
    medium: Medium = Medium.GPU


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    event_id: int
    dp_rank: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
