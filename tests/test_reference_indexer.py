"""The reference indexer itself: hash vectors, each violation kind, clean streams, overlap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from engined.core.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium
from tests.reference_indexer import (
    ReferenceIndexer,
    local_block_hash,
    next_sequence_hash,
    nth_stored_hashes,
    removed_event_count,
    sequence_hashes,
    stored_hashes,
    vllm_block_hash,
    vllm_event_hash,
)

BS = 4


def stored(
    event_id: int,
    tokens: Sequence[int],
    first_block: int = 0,
    *,
    dp_rank: int = 0,
    medium: Medium = Medium.GPU,
) -> BlockStored:
    """A correct Stored for the full blocks of `tokens` from block `first_block` on."""
    seqs = sequence_hashes(tokens, BS)
    n = len(seqs)
    body = list(tokens[first_block * BS : n * BS])
    return BlockStored(
        event_id=event_id,
        dp_rank=dp_rank,
        parent_hash=seqs[first_block - 1] if first_block > 0 else None,
        block_hashes=seqs[first_block:],
        local_hashes=[local_block_hash(body[i : i + BS]) for i in range(0, len(body), BS)],
        token_ids=body,
        block_size=BS,
        medium=medium,
    )


def removed(
    event_id: int, hashes: list[int], *, dp_rank: int = 0, medium: Medium = Medium.GPU
) -> BlockRemoved:
    return BlockRemoved(event_id=event_id, dp_rank=dp_rank, block_hashes=hashes, medium=medium)


def apply(events: list[KvEvent], **kwargs: Any) -> ReferenceIndexer:
    indexer = ReferenceIndexer(BS, **kwargs)
    indexer.apply(events)
    return indexer


# --- hashing --------------------------------------------------------------------------------


def test_hash_vectors_from_mocker_core() -> None:
    """docs/upstream/dynamo-mocker.md §3.1 (the first five are upstream `lib/tokens` vectors)."""
    assert local_block_hash([1, 2, 3, 4]) == 14643705804678351452
    assert local_block_hash([5, 6, 7, 8]) == 16777012769546811212
    assert local_block_hash([9, 10, 11, 12]) == 483935686894639516
    assert local_block_hash([0, 1, 2, 3]) == 9143094415614847814
    assert local_block_hash([4, 5, 6, 7]) == 12124091508212882195
    assert sequence_hashes(list(range(1, 9)), BS)[1] == 4945711292740353085
    assert sequence_hashes(list(range(1, 13)), BS)[2] == 12583592247330656132
    assert sequence_hashes(list(range(8)), BS) == [9143094415614847814, 9510318385840434533]
    assert next_sequence_hash(9143094415614847814, 12124091508212882195) == 9510318385840434533


def test_sequence_hashes_ignore_partial_tail() -> None:
    assert sequence_hashes(list(range(11)), BS) == sequence_hashes(list(range(8)), BS)
    assert sequence_hashes([1, 2, 3], BS) == []


# --- clean streams --------------------------------------------------------------------------


def test_first_stored_event_of_mocker_core_example_is_clean() -> None:
    """docs/upstream/dynamo-mocker.md §3.2: prompt 0..8 (bs 4) gives one Stored at the root."""
    event = BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=None,
        block_hashes=[9143094415614847814, 9510318385840434533],
        local_hashes=[9143094415614847814, 12124091508212882195],
        token_ids=list(range(8)),
        block_size=BS,
    )
    indexer = apply([event])
    indexer.assert_clean()
    assert indexer.blocks() == {9143094415614847814, 9510318385840434533}


def test_clean_stream_of_stores_and_leaf_first_removals() -> None:
    prompt = list(range(100, 116))
    seqs = sequence_hashes(prompt, BS)
    other = list(range(500, 508))
    events: list[KvEvent] = [
        stored(7, prompt[:8]),
        stored(8, prompt, first_block=2),
        stored(9, other),
        removed(10, [seqs[3], seqs[2]]),
        removed(11, [sequence_hashes(other, BS)[1]]),
        stored(12, prompt[:12], first_block=2),
    ]
    indexer = apply(events)
    indexer.assert_clean()
    assert indexer.ok_count("stored") == 4
    assert indexer.ok_count("removed") == 2
    assert indexer.blocks() == {*seqs[:3], sequence_hashes(other, BS)[0]}
    assert indexer.num_blocks() == 4
    assert indexer.num_blocks(dp_rank=1) == 0
    assert indexer.num_blocks(worker_id=1) == 0


def test_removing_a_parent_keeps_its_children_indexed() -> None:
    prompt = list(range(12))
    seqs = sequence_hashes(prompt, BS)
    indexer = apply([stored(0, prompt[:8]), removed(1, [seqs[0]]), stored(2, prompt, 2)])
    indexer.assert_clean()
    assert indexer.blocks() == {seqs[1], seqs[2]}


def test_all_blocks_cleared_clears_every_medium_of_that_rank_only() -> None:
    prompt = list(range(8))
    indexer = ReferenceIndexer(BS)
    indexer.apply(
        [
            stored(0, prompt),
            stored(1, prompt, medium=Medium.CPU),
            stored(0, prompt, dp_rank=1),
            AllBlocksCleared(event_id=2, dp_rank=0),
            stored(3, prompt),
        ]
    )
    indexer.apply([stored(0, prompt)], worker_id=9)
    indexer.assert_clean()
    assert indexer.ok_count("cleared") == 1
    assert indexer.num_blocks(medium=Medium.CPU) == 0
    assert indexer.num_blocks() == 2
    assert indexer.num_blocks(dp_rank=1) == 2
    assert indexer.num_blocks(worker_id=9) == 2


def test_checks_can_be_switched_off() -> None:
    event = stored(0, list(range(8)))
    wrong_local = BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=None,
        block_hashes=[event.block_hashes[0] ^ 1, event.block_hashes[1]],
        local_hashes=[event.local_hashes[0] ^ 1, event.local_hashes[1]],
        token_ids=event.token_ids,
        block_size=BS,
    )
    assert apply([wrong_local], check_local_hashes=False, check_chain=False).violations == []
    assert apply([wrong_local], check_chain=False).kinds() == ["local_hash_mismatch"]
    assert apply([wrong_local], check_local_hashes=False).kinds() == ["chain_mismatch"]


# --- violations -----------------------------------------------------------------------------


def test_parent_block_not_found_stores_nothing() -> None:
    prompt = list(range(12))
    indexer = apply([stored(0, prompt, first_block=1)])
    assert indexer.kinds() == ["parent_block_not_found"]
    assert indexer.num_blocks() == 0
    assert indexer.ok_count("stored") == 0


def test_parent_must_be_on_the_same_worker_rank_and_medium() -> None:
    prompt = list(range(8))
    indexer = ReferenceIndexer(BS)
    indexer.apply([stored(0, prompt[:4])])
    indexer.apply([stored(1, prompt, 1, medium=Medium.CPU)])
    indexer.apply([stored(2, prompt, 1, dp_rank=1)])
    indexer.apply([stored(0, prompt, 1)], worker_id=3)
    assert indexer.kinds() == ["parent_block_not_found"] * 3
    assert indexer.num_blocks() == 1


def test_lower_tier_edges_need_no_indexed_parent_but_keep_every_other_check() -> None:
    """Offloaded blocks arrive leaf first: Dynamo's lower tiers index continuation edges."""
    prompt = list(range(12))
    seqs = sequence_hashes(prompt, BS)
    indexer = apply(
        [
            stored(0, prompt[:8]),
            stored(1, prompt, 2, medium=Medium.CPU),  # parent (block 1) is only on the GPU
            stored(2, prompt, 1, medium=Medium.STORAGE),
            stored(3, prompt, 2, medium=Medium.CPU),  # the same block again
            removed(4, [seqs[0]], medium=Medium.CPU),  # never stored on the CPU
        ],
        lower_tier_edges=True,
    )
    assert indexer.kinds() == ["duplicate_store", "block_not_found"]
    assert indexer.blocks(medium=Medium.CPU) == {seqs[2]}
    # Lower tiers continue from the device-tier match: blocks 0-1 on the GPU, then block 2.
    assert indexer.overlap(prompt) == 2
    assert indexer.tier_overlap(prompt, Medium.CPU) == 1
    assert indexer.tier_overlap(prompt, Medium.STORAGE) == 1
    indexer.apply([removed(5, [seqs[1]])])
    assert indexer.tier_overlap(prompt, Medium.CPU) == 0, "no chain from the GPU match"
    assert indexer.tier_overlap(prompt, Medium.STORAGE) == 2
    # The GPU tier keeps the router's rooted-tree rule.
    strict = apply([stored(0, prompt, 2)], lower_tier_edges=True)
    assert strict.kinds() == ["parent_block_not_found"]


def test_invalid_block_when_parent_is_one_of_its_own_blocks() -> None:
    good = stored(0, list(range(8)))
    bad = BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=good.block_hashes[1],
        block_hashes=good.block_hashes,
        local_hashes=good.local_hashes,
        token_ids=good.token_ids,
        block_size=BS,
    )
    indexer = apply([bad])
    assert indexer.kinds() == ["invalid_block"]
    assert indexer.num_blocks() == 0


def test_duplicate_store() -> None:
    prompt = list(range(8))
    indexer = apply([stored(0, prompt), stored(1, prompt)])
    assert indexer.kinds() == ["duplicate_store"]
    assert "already indexed" in indexer.violations[0].detail
    assert indexer.ok_count("stored") == 2
    assert indexer.num_blocks() == 2


def test_partial_duplicate_store_is_flagged_and_adds_the_new_block() -> None:
    prompt = list(range(12))
    indexer = apply([stored(0, prompt[:8]), stored(1, prompt, first_block=1)])
    assert indexer.kinds() == ["duplicate_store"]
    assert indexer.num_blocks() == 3


def test_block_not_found() -> None:
    prompt = list(range(8))
    seqs = sequence_hashes(prompt, BS)
    indexer = apply([stored(0, prompt), removed(1, [seqs[1], 12345]), removed(2, [seqs[1]])])
    assert indexer.kinds() == ["block_not_found", "block_not_found"]
    assert "12345" in indexer.violations[0].detail
    assert indexer.blocks() == {seqs[0]}
    assert indexer.ok_count("removed") == 0


def test_removed_on_another_medium_is_not_found() -> None:
    prompt = list(range(4))
    indexer = apply([stored(0, prompt), removed(1, sequence_hashes(prompt, BS), medium=Medium.CPU)])
    assert indexer.kinds() == ["block_not_found"]
    assert indexer.num_blocks() == 1


@pytest.mark.parametrize(
    "mutation",
    [
        {"token_ids": list(range(7))},
        {"token_ids": list(range(12))},
        {"local_hashes": [1]},
        {"block_size": 8},
        {"block_hashes": [], "local_hashes": [], "token_ids": []},
        {"token_ids": [0, 1, 2, 3, 4, 5, 6, 2**32]},
    ],
)
def test_bad_shape(mutation: dict[str, object]) -> None:
    good = stored(0, list(range(8)))
    fields: dict[str, object] = {
        "event_id": 0,
        "dp_rank": 0,
        "parent_hash": None,
        "block_hashes": good.block_hashes,
        "local_hashes": good.local_hashes,
        "token_ids": good.token_ids,
        "block_size": BS,
    }
    fields.update(mutation)
    indexer = apply([BlockStored(**fields)])  # type: ignore[arg-type]
    assert indexer.kinds() == ["bad_shape"]
    assert indexer.num_blocks() == 0


def test_empty_removed_is_bad_shape() -> None:
    assert apply([removed(0, [])]).kinds() == ["bad_shape"]


def test_local_hash_mismatch() -> None:
    """A local hash that is not the tokens' hash, with a chain consistent with that hash."""
    tokens = [1, 2, 3, 4]
    indexer = apply(
        [
            BlockStored(
                event_id=0,
                dp_rank=0,
                parent_hash=None,
                block_hashes=[42],
                local_hashes=[42],
                token_ids=tokens,
                block_size=BS,
            )
        ]
    )
    assert indexer.kinds() == ["local_hash_mismatch"]
    assert "14643705804678351452" in indexer.violations[0].detail
    assert indexer.blocks() == {42}


def test_chain_mismatch_at_root_and_after_parent() -> None:
    prompt = list(range(1, 13))
    seqs = sequence_hashes(prompt, BS)
    root = stored(0, prompt[:4])
    not_chained_root = BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=None,
        block_hashes=[seqs[0] + 1],
        local_hashes=root.local_hashes,
        token_ids=root.token_ids,
        block_size=BS,
    )
    assert apply([not_chained_root]).kinds() == ["chain_mismatch"]

    tail = stored(1, prompt, first_block=1)
    local_as_identity = BlockStored(
        event_id=1,
        dp_rank=0,
        parent_hash=seqs[0],
        block_hashes=tail.local_hashes,
        local_hashes=tail.local_hashes,
        token_ids=tail.token_ids,
        block_size=BS,
    )
    indexer = apply([root, local_as_identity])
    assert indexer.kinds() == ["chain_mismatch"]
    assert "block 0" in indexer.violations[0].detail


def test_event_id_gap_per_worker_and_rank() -> None:
    a, b, c = list(range(4)), list(range(4, 8)), list(range(8, 12))
    indexer = ReferenceIndexer(BS)
    indexer.apply([stored(5, a), stored(6, b), stored(8, c)])
    indexer.apply([stored(0, a, dp_rank=1), stored(1, b, dp_rank=1)])
    indexer.apply([stored(100, a)], worker_id=2)
    indexer.apply([AllBlocksCleared(event_id=9, dp_rank=0), stored(9, a)])
    assert indexer.kinds() == ["event_id_gap", "event_id_gap"]
    assert "event id 8 follows 6" in indexer.violations[0].detail
    assert "event id 9 follows 9" in indexer.violations[1].detail


def test_assert_clean_lists_violations() -> None:
    indexer = apply([removed(0, [1]), removed(1, [2])])
    with pytest.raises(AssertionError, match="2 KV event violations") as info:
        indexer.assert_clean()
    assert "block_not_found (worker 0, event 1)" in str(info.value)


# --- overlap and helpers --------------------------------------------------------------------


def test_overlap_counts_leading_indexed_blocks() -> None:
    prompt = list(range(10, 26))
    seqs = sequence_hashes(prompt, BS)
    indexer = apply([stored(0, prompt[:12])])
    assert indexer.overlap([*prompt, 1, 2]) == 3
    assert indexer.overlap(prompt[:7]) == 1
    assert indexer.overlap([99, *prompt[1:]]) == 0
    assert indexer.overlap(prompt, dp_rank=1) == 0
    assert indexer.overlap(prompt, medium=Medium.CPU) == 0
    indexer.apply([removed(1, [seqs[1]])])
    assert indexer.overlap(prompt) == 1
    indexer.apply([removed(2, [seqs[0]])])
    assert indexer.overlap(prompt) == 0
    assert indexer.num_blocks() == 1


def test_stream_helpers() -> None:
    a, b = list(range(8)), list(range(20, 24))
    events: list[KvEvent] = [
        stored(0, a),
        removed(1, sequence_hashes(a, BS)[1:]),
        stored(2, b),
        AllBlocksCleared(event_id=3, dp_rank=0),
        removed(4, [1]),
    ]
    assert stored_hashes(events) == [
        9143094415614847814,
        12124091508212882195,
        local_block_hash(b),
    ]
    assert nth_stored_hashes(events, 1) == [local_block_hash(b)]
    assert removed_event_count(events) == 2


def test_vllm_chains_take_the_adapter_and_salt_back_from_the_event() -> None:
    """A salted LoRA request's two blocks: vLLM keys both with ("lora", name, path) and the
    first with the salt too; the event names the adapter's id and name, and the path comes
    from `lora_paths`. Another path for that id is a chain mismatch."""
    tokens = list(range(8))
    first = vllm_block_hash(None, tokens[:4], (("lora", "a", "/a"), ("cache_salt", "s")))
    second = vllm_block_hash(first, tokens[4:], (("lora", "a", "/a"),))
    event = BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=None,
        block_hashes=[vllm_event_hash(first), vllm_event_hash(second)],
        local_hashes=[local_block_hash(tokens[:4]), local_block_hash(tokens[4:])],
        token_ids=tokens,
        block_size=BS,
        extra_keys=[("a", "s"), ("a",)],
        lora_id=3,
        lora_name="a",
    )
    assert apply([event], vllm=True, lora_paths={3: "/a"}).violations == []
    assert apply([event], vllm=True, lora_paths={3: "/b"}).kinds() == ["chain_mismatch"]
