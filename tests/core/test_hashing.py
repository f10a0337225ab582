"""Block identities equal the router's (docs/upstream/dynamo-mocker.md §3.1 test vectors)."""

from __future__ import annotations

import itertools
import random

from engined.core.hashing import (
    block_hashes,
    chain_hash,
    hash_of_key,
    lineage_key,
    local_block_hash,
    parent_lineage_key,
)
from engined.core.sequence import Sequence


def test_local_block_hashes_match_upstream_vectors() -> None:
    assert local_block_hash([1, 2, 3, 4]) == 14643705804678351452
    assert local_block_hash([5, 6, 7, 8]) == 16777012769546811212
    assert local_block_hash([9, 10, 11, 12]) == 483935686894639516
    assert local_block_hash([0, 1, 2, 3]) == 9143094415614847814
    assert local_block_hash([4, 5, 6, 7]) == 12124091508212882195


def test_sequence_hashes_chain_like_upstream() -> None:
    local, seq = block_hashes(list(range(1, 13)), 4)
    assert seq[0] == local[0] == 14643705804678351452
    assert seq[1] == 4945711292740353085
    assert seq[2] == 12583592247330656132
    assert chain_hash(seq[0], local[1]) == seq[1]
    _, seq = block_hashes(list(range(8)), 4)
    assert seq == [9143094415614847814, 9510318385840434533]


def test_sequence_blocks_use_the_same_hashes_including_generated_blocks() -> None:
    """A sequence hashes its prompt blocks at creation and each generated block on promotion."""
    tokens = list(range(6))
    seq = Sequence(
        tokens,
        4,
        4,
        caching=True,
        rng=random.Random(0),
        token_bits=random.Random(0).getrandbits,
        next_partial_id=itertools.count().__next__,
        planned=[6, 7, 8, 9],
    )
    assert seq.hashes == [9143094415614847814]
    for _ in range(4):
        seq.generate_token()
    _, expected = block_hashes(list(range(10)), 4)
    assert seq.hashes == expected
    assert seq.local == block_hashes(list(range(10)), 4)[0]


def make_sequence(tokens: list[int], *, caching: bool, planned: list[int]) -> Sequence:
    return Sequence(
        tokens,
        len(planned),
        4,
        caching=caching,
        rng=random.Random(7),
        token_bits=random.Random(7).getrandbits,
        next_partial_id=itertools.count().__next__,
        planned=planned,
    )


def test_a_registered_key_names_its_blocks_hash() -> None:
    """The pool keys blocks by lineage key and Removed events need the hash back
    (`hash_of_key`): the key itself with caching, its low 64 bits without."""
    assert hash_of_key(0) == 0
    assert hash_of_key(2**64 - 1) == 2**64 - 1
    for position in (0, 1, 4095, 4096, 70_000):
        for h in (0, 1, 2**63, 2**64 - 1):
            key = lineage_key(position, h)
            assert key == (position << 64) | h
            assert hash_of_key(key) == h
    assert parent_lineage_key(0) is None
    assert parent_lineage_key(5) == lineage_key(4, 0)


def test_with_caching_keys_are_the_hashes_and_parents_the_previous_block() -> None:
    seq = make_sequence(list(range(10)), caching=True, planned=[10, 11, 12, 13, 14, 15, 16])
    for _ in range(7):
        seq.generate_token()
    assert len(seq.hashes) == 4
    assert seq.keys is seq.hashes
    assert [seq.parent_key(pos) for pos in range(4)] == [None, *seq.hashes[:3]]
    use = seq.prepare_allocation(len(seq.tokens))
    assert use is not None and use.first == 0
    assert use.keys == use.hashes == seq.hashes
    assert [use.parent_key(i) for i in range(4)] == [None, *seq.hashes[:3]]
    seq.num_allocated_tokens = 8
    later = seq.prepare_allocation(len(seq.tokens))
    assert later is not None and later.first == 2
    assert [later.parent_key(i) for i in range(2)] == seq.hashes[1:3]


def test_without_caching_keys_carry_the_position() -> None:
    seq = make_sequence(list(range(10)), caching=False, planned=[10, 11, 12, 13, 14, 15, 16])
    for _ in range(7):
        seq.generate_token()
    assert len(seq.hashes) == 4
    assert seq.keys == [lineage_key(pos, h) for pos, h in enumerate(seq.hashes)]
    assert [hash_of_key(key) for key in seq.keys] == seq.hashes
    assert [seq.parent_key(pos) for pos in range(4)] == [None, *map(parent_lineage_key, [1, 2, 3])]
    seq.num_allocated_tokens = 8
    use = seq.prepare_allocation(len(seq.tokens))
    assert use is not None and use.first == 2 and use.local is None
    assert use.keys == seq.keys[2:4]
    assert [use.parent_key(i) for i in range(2)] == [lineage_key(1, 0), lineage_key(2, 0)]
