"""Block identities equal the router's (docs/upstream/dynamo-mocker.md §3.1 test vectors)."""

from __future__ import annotations

import itertools
import random

from engined.core.hashing import block_hashes, chain_hash, local_block_hash
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
        next_partial_id=itertools.count().__next__,
        planned=[6, 7, 8, 9],
    )
    assert seq.hashes == [9143094415614847814]
    for _ in range(4):
        seq.generate_token()
    _, expected = block_hashes(list(range(10)), 4)
    assert seq.hashes == expected
    assert seq.local == block_hashes(list(range(10)), 4)[0]
