"""Block identities as Dynamo's router computes them: xxh3-64, seed 1337.

A block's *local* hash covers its tokens only (u32 little-endian); its *sequence* hash chains
the parent's sequence hash with the local hash, so equal sequence hashes mean equal prefixes.
Routers compute the same values from a prompt, which is what makes prefix-aware routing work
against this engine.

The block pool keys blocks by a *lineage key*, with the parent's key as the parent link that
gives eviction its tree shape. With prefix caching the key is the sequence hash itself: it
already names the whole prefix, so its position too, and it is a 64-bit int (a 128-bit one
costs an allocation per key when compiled, and more per dict lookup). Without caching the
sequence hashes are random: `lineage_key` folds the position in, `(position << 64) | hash`,
with the parent key `lineage_key(position - 1, 0)`, so blocks stay apart by position.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Final, NamedTuple

import xxhash

from engined.core.named_tuples import new_tuple

HASH_SEED: Final = 1337

# NOTE: the seed goes positionally: xxhash parses keyword arguments on every call.
_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
# NOTE: the unbound method: compiled, `block.tobytes()` looks the name up on every call.
_tobytes: Final = array.tobytes
_NATIVE_LE = sys.byteorder == "little"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as little-endian u32, the byte layout the hashes are defined over."""
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _NATIVE_LE:
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def local_block_hash(tokens: Sequence[int]) -> int:
    return _xxh3(token_bytes(tokens), HASH_SEED)


def array_block_hash(block: array[int]) -> int:
    """`local_block_hash` of an `array("I")` (a sequence's tokens), without the type checks."""
    if _NATIVE_LE:
        return _xxh3(_tobytes(block), HASH_SEED)
    return local_block_hash(block)


def chain_hash(parent: int, local: int) -> int:
    return _xxh3(_pack_pair(parent, local), HASH_SEED)


def sequence_hash(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose local hash is `local`; `parent` None at the root."""
    return local if parent is None else _xxh3(_pack_pair(parent, local), HASH_SEED)


class BlockHashes(NamedTuple):
    """The local and the sequence hash of every full block, in block order."""

    local: list[int]
    sequence: list[int]


def block_hashes(tokens: Sequence[int], block_size: int, root: int | None = None) -> BlockHashes:
    """Local and sequence hashes of every full block of `tokens`; with a `root` (a cache
    salt's, `salt_root`) the first block chains to it as to a parent."""
    data = token_bytes(tokens)
    step = block_size * 4
    n = len(tokens) // block_size
    xxh3 = _xxh3
    pack_pair = _pack_pair
    local = [xxh3(data[i * step : (i + 1) * step], HASH_SEED) for i in range(n)]
    if not n:
        return new_tuple(BlockHashes, (local, []))
    # NOTE: the first block outside the loop keeps `parent` a plain int in it, which the
    # compiled core does not box and test for None per block.
    first = local[0]
    parent: int = first if root is None else xxh3(pack_pair(root, first), HASH_SEED)
    seq = [parent]
    for i in range(1, n):
        parent = xxh3(pack_pair(parent, local[i]), HASH_SEED)
        seq.append(parent)
    return new_tuple(BlockHashes, (local, seq))


_SALT_TAG: Final = b"engined/cache-salt\x00"
_LORA_TAG: Final = b"engined/lora\x00"


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def salt_root(salt: str) -> int:
    """The parent a salted request's first block chains to: requests with other salts (or
    none) then share no block key, as vLLM's salted block hashes share nothing."""
    return _xxh3(_SALT_TAG + _text(salt), HASH_SEED)


def chain_root(salt: str | None, lora: tuple[str, str] | None) -> int | None:
    """The parent a request's first block chains to (None: none, a base-model request
    without salt). vLLM keys every block of a LoRA request with the adapter's name and path
    and a salted request's first block with its salt, so requests share blocks only when
    all three are equal; rooting the chain in them keeps the block keys apart as well. Each
    field is length-prefixed, so no two (name, path, salt) share their bytes."""
    if lora is None:
        return None if salt is None else salt_root(salt)
    fields = [*lora] if salt is None else [*lora, salt]
    data = b"".join(struct.pack("<Q", len(raw)) + raw for raw in map(_text, fields))
    return _xxh3(_LORA_TAG + data, HASH_SEED)


# `position << 64` for the positions of prompts up to 64k tokens of 16: a lookup instead of
# the shift, which allocates twice when compiled (a 128-bit int is no machine word).
_POSITION_BASES: Final = [position << 64 for position in range(4096)]


def lineage_key(position: int, sequence_hash: int) -> int:
    if position < 4096:
        return _POSITION_BASES[position] | sequence_hash
    return (position << 64) | sequence_hash


def parent_lineage_key(position: int) -> int | None:
    """Without caching, the parent key of the block at `position` (None for the first)."""
    return lineage_key(position - 1, 0) if position else None


_HASH_BITS: Final = (1 << 64) - 1


def hash_of_key(key: int) -> int:
    """The sequence hash of the block registered under lineage key `key`: the key itself
    with caching, its low 64 bits without."""
    return key if key <= _HASH_BITS else key & _HASH_BITS
