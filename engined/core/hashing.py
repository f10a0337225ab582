"""Block identities as Dynamo's router computes them: xxh3-64, seed 1337.

A block's *local* hash covers its tokens only (u32 little-endian); its *sequence* hash chains
the parent's sequence hash with the local hash, so equal sequence hashes mean equal prefixes.
Routers compute the same values from a prompt, which is what makes prefix-aware routing work
against this engine.

The block pool keys blocks by a *positional lineage key*: `(position << 64) | sequence_hash`,
with the parent key at `position - 1`. Folding the position in keeps blocks apart whose
sequence hashes are random (prefix caching off) and gives eviction its tree shape.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

HASH_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_NATIVE_LE = sys.byteorder == "little"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as little-endian u32, the byte layout the hashes are defined over."""
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _NATIVE_LE:
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def local_block_hash(tokens: Sequence[int]) -> int:
    return _xxh3(token_bytes(tokens), seed=HASH_SEED)


def chain_hash(parent: int, local: int) -> int:
    return _xxh3(_pack_pair(parent, local), seed=HASH_SEED)


def sequence_hash(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose local hash is `local`; `parent` None at the root."""
    return local if parent is None else _xxh3(_pack_pair(parent, local), seed=HASH_SEED)


class BlockHashes(NamedTuple):
    """The local and the sequence hash of every full block, in block order."""

    local: list[int]
    sequence: list[int]


def block_hashes(tokens: Sequence[int], block_size: int) -> BlockHashes:
    """Local and sequence hashes of every full block of `tokens`."""
    data = token_bytes(tokens)
    step = block_size * 4
    n = len(tokens) // block_size
    local = [_xxh3(data[i * step : (i + 1) * step], seed=HASH_SEED) for i in range(n)]
    seq: list[int] = []
    parent = 0
    for i, h in enumerate(local):
        parent = h if i == 0 else _xxh3(_pack_pair(parent, h), seed=HASH_SEED)
        seq.append(parent)
    return BlockHashes(local, seq)


def lineage_key(position: int, sequence_hash: int) -> int:
    return (position << 64) | sequence_hash
