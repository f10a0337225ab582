"""Block hashes as vLLM 0.33 computes them for prefix caching and KV events.

vLLM hashes a full block as `hash_fn((parent, tokens, extra_keys))`, the parent being the
previous block's hash or, for a first block, `NONE_HASH`; `hash_fn` is picked by
`--prefix-caching-hash-algo` (`sha256` by default, `sha256_cbor`, `xxhash`, `xxhash_cbor`):
pickle or canonical CBOR serialisation, then SHA-256 or xxh3-128. `NONE_HASH` is
`hash_fn(seed)`: the seed is `PYTHONHASHSEED` when set; otherwise the fixed
`"vllm-none-hash"` for the SHA-256 algorithms and 32 random bytes (hex) per process for the
xxhash ones, so their hashes are reproducible only with `PYTHONHASHSEED` set. KV events carry
a hash as the low 64 bits of its big-endian value unless `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
is 0, when they carry the bytes.

Extra keys (`block_extra_keys`), as vLLM's `generate_block_hash_extra_keys` makes them from
what engined's requests carry (no multimodal input or prompt embeds): a LoRA request's
`("lora", name, path)` on every block, then a `cache_salt`'s `("cache_salt", salt)` on the
first block only. KV events carry each untagged (`event_extra_keys`): `(name, salt)`,
`(name,)`, `(salt,)`.
Pickle is pinned at protocol 5, what `pickle.HIGHEST_PROTOCOL` is on every Python vLLM 0.33
runs on; the CBOR encoder covers the types a block key holds (bytes, str, ints, None, tuples)
in RFC 8949's canonical form, as `cbor2.dumps(canonical=True)` writes them.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
import secrets
from collections.abc import Callable, Sequence
from typing import Final

import xxhash

from engined.core.types import LoraRequest

# `chain(parent, tokens, start, count, block_size)`: the hashes of `count` full blocks of
# `tokens` from `start`, the first chained to `parent` (no extra keys).
Chain = Callable[[bytes, list[int], int, int, int], list[bytes]]

try:  # the compiled core's C block hash (engined/core/_block_hash.c); the pure core has none
    from engined.core._block_hash import sha256_pickle_chain as _c_chain
except ImportError:
    _native_chain: Chain | None = None
else:
    _native_chain = _c_chain


class HashAlgo(enum.StrEnum):
    """vLLM 0.33's `PrefixCachingHashAlgo` choices."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"


DEFAULT_HASH_ALGO: Final = HashAlgo.SHA256
# vLLM's seed of NONE_HASH for the collision-resistant algorithms without PYTHONHASHSEED.
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
_PICKLE_PROTOCOL: Final = 5
_U64_MASK: Final = (1 << 64) - 1

CborValue = bytes | str | int | None | tuple["CborValue", ...]
# A block's extra keys: tagged tuples of strings (`("lora", name, path)`, ...).
ExtraKeys = tuple[tuple[str, ...], ...]
# A block's extra keys under lookahead hashes (MTP): its own and the token after it.
LookaheadKeys = tuple[ExtraKeys | None, int]


def _head(major: int, value: int) -> bytes:
    """A CBOR item head with the shortest argument (canonical form)."""
    if value < 24:
        return bytes([major << 5 | value])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | extra]) + value.to_bytes(size, "big")
    raise ValueError(f"CBOR argument {value} does not fit in 64 bits")


def cbor_canonical(value: CborValue) -> bytes:
    """RFC 8949 canonical CBOR of the values a block key holds."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("a block key holds no booleans")
    if isinstance(value, int):
        if value >= 0:
            if value <= _U64_MASK:
                return _head(0, value)
            raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
            return b"\xc2" + _head(2, len(raw)) + raw
        magnitude = -1 - value
        if magnitude <= _U64_MASK:
            return _head(1, magnitude)
        raw = magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "big")
        return b"\xc3" + _head(2, len(raw)) + raw
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode()
        return _head(3, len(encoded)) + encoded
    return _head(4, len(value)) + b"".join(cbor_canonical(item) for item in value)


def _pickled(value: object) -> bytes:
    return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)


def _cbor(value: object) -> bytes:
    assert isinstance(value, (bytes, str, int, tuple)) or value is None
    return cbor_canonical(value)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# NOTE: compiled, a Final name is a C static; a module attribute is a lookup per call.
_dumps: Final = pickle.dumps
_sha256_new: Final = hashlib.sha256


def _serialiser(algo: HashAlgo) -> Callable[[object], bytes]:
    return _cbor if algo in (HashAlgo.SHA256_CBOR, HashAlgo.XXHASH_CBOR) else _pickled


def _digest(algo: HashAlgo) -> Callable[[bytes], bytes]:
    return _sha256 if algo in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR) else xxhash.xxh3_128_digest


def is_collision_resistant(algo: HashAlgo) -> bool:
    """vLLM derives NONE_HASH from a fixed seed only for these (SHA-256) algorithms."""
    return algo in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR)


def none_hash(algo: HashAlgo, python_hash_seed: str | None) -> bytes:
    """vLLM's NONE_HASH: the parent of every first block.

    `python_hash_seed` is the process's `PYTHONHASHSEED` (None when unset). Unset, the xxhash
    algorithms get a random seed, as vLLM does, so their hashes differ from run to run.
    """
    if python_hash_seed is not None:
        seed = python_hash_seed
    elif is_collision_resistant(algo):
        seed = DEFAULT_NONE_HASH_SEED
    else:
        seed = secrets.token_bytes(32).hex()
    return _digest(algo)(_serialiser(algo)(seed))


class BlockHasher:
    """`hash_block_tokens` of vLLM 0.33 for one algorithm and NONE_HASH."""

    __slots__ = ("_digest", "_serialise", "algo", "none_hash")

    def __init__(self, algo: HashAlgo, none_hash: bytes) -> None:
        self._serialise = _serialiser(algo)
        self._digest = _digest(algo)
        self.algo = algo
        self.none_hash = none_hash

    def block_hash(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        extra_keys: ExtraKeys | LookaheadKeys | None = None,
    ) -> bytes:
        """The hash of a full block of `tokens` whose previous block hashed to `parent`."""
        # vLLM tests `not parent_block_hash`: an empty parent is a first block too.
        key = (parent or self.none_hash, tuple(tokens), extra_keys)
        return self._digest(self._serialise(key))


def _sha256_pickle_chain(
    parent: bytes, tokens: list[int], start: int, count: int, block_size: int
) -> list[bytes]:
    """The C module's `sha256_pickle_chain` in Python: `BlockHasher.block_hash` of the
    default algorithm, inlined (a call per block cost the pure core a few percent)."""
    hashes: list[bytes] = []
    for first in range(start, start + count * block_size, block_size):
        key = (parent, tuple(tokens[first : first + block_size]), None)
        parent = _sha256_new(_dumps(key, 5)).digest()
        hashes.append(parent)
    return hashes


def native_chain(algo: HashAlgo, block_size: int) -> Chain | None:
    """vLLM's default block hash chained over blocks without extra keys, or None for the
    other algorithms (`BlockHasher`): in C where the compiled core has it and it covers the
    block size (its pickle bytes are CPython's only for tuples of 4 to 1024 tokens), else
    in Python."""
    if algo is not HashAlgo.SHA256:
        return None
    if _native_chain is not None and 4 <= block_size <= 1024:
        return _native_chain
    return _sha256_pickle_chain


def block_extra_keys(lora: LoraRequest | None, salt: str | None) -> ExtraKeys | None:
    """The extra keys vLLM hashes a block with: the adapter's on every block of a LoRA
    request, then the salt, which the caller passes for a salted request's first block
    only; None when there are none (the chains cover only those blocks)."""
    if lora is None:
        return None if salt is None else (("cache_salt", salt),)
    adapter = ("lora", lora.lora_name, lora.lora_path)
    return (adapter,) if salt is None else (adapter, ("cache_salt", salt))


def event_extra_keys(keys: ExtraKeys | None) -> tuple[str, ...] | None:
    """A block's extra keys as vLLM's KV events publish them (`to_event_extra_keys`):
    untagged, the bare adapter name and salt (engined has no multimodal keys, the only ones
    published with more than their second field)."""
    return None if keys is None else tuple(key[1] for key in keys)


def event_block_hash(h: bytes, *, int_hashes: bool = True) -> int | bytes:
    """A block hash as vLLM's KV events carry it (`maybe_convert_block_hash`).

    `int_hashes` is `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (vLLM's default 1): the hash's low 64
    bits as an unsigned int; 0 keeps the bytes.
    """
    if not int_hashes:
        return h
    return int.from_bytes(h, "big") & _U64_MASK


def event_block_hash_int(h: bytes) -> int:
    """`event_block_hash` in vLLM's default form (an int), typed as such for the KV path."""
    return int.from_bytes(h[-8:], "big")
