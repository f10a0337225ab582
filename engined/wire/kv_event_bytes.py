"""vLLM 0.33's map-format `BlockRemoved` written as bytes, and the block hash the wire carries.

Why bytes: vLLM publishes one `BlockRemoved` per evicted block, so under a full pool a pass
publishes about one per eight tokens, and building a wire Struct per event to encode it was
the dearest part of the KV path (0.54 us an event compiled; 0.39 as bytes). An event is its
encoding's fixed head and tail with the hash written between them, as one `msgspec.Raw` the
batch encoder copies in. Head and tail are cut, at construction, from the encoding of a
sentinel event built with the wire Struct itself (engined/wire/kv_events.py passes it in),
so the bytes stay msgspec's; tests/wire/test_kv_event_bytes.py holds them to the Struct
path. (`BlockStored` gains nothing this way: its token list needs an encoder call anyway.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from msgspec import Raw

from engined.core.block_events import BlockRemoved, Medium
from engined.wire.constraints import U32_LIMIT, U64_LIMIT

_REMAP_BIT: Final = 1 << 63
# A hash whose encoding occurs once in the sentinel event (its 8 bytes are distinct).
_HASH: Final = 0xA1A2A3A4A5A6A7A8
_ONE_HASH: Final = b"\x91\xcf"  # a one-element array of a uint64
_GPU: Final = Medium.GPU


def wire_hash(h: int) -> int:
    """The block hash to publish for the core's u64 sequence hash `h`.

    Go consumers (llm-d, vmihailenco/msgpack) decode a hash below 2**32 as a narrow int type
    and reject the whole batch, so a hash must encode as msgpack uint64 (`cf`). Hashes at or
    above 2**32 pass unchanged; a smaller one gets bit 63 set, which maps [0, 2**32) one to one
    onto [2**63, 2**63 + 2**32). Deterministic, so stores, removals and parent links agree.

    NOTE on collisions: no map from 2**64 values into [2**32, 2**64) is injective. Here a
    remapped `x` can only collide with a genuine hash equal to `2**63 + x`. For uniform 64-bit
    hashes a block needs the remap with probability 2**-32, and its image then meets one of N
    live genuine hashes with probability N / 2**64: the remap adds about N**2 * 2**-96 to the
    N**2 * 2**-65 birthday risk every 64-bit block hash already carries.
    """
    if U32_LIMIT <= h < U64_LIMIT:
        return h
    if 0 <= h < U32_LIMIT:
        return h | _REMAP_BIT
    raise ValueError(f"block hash {h} is not an unsigned 64-bit int")


class RemovedEventBytes:
    """Writes core `BlockRemoved` events as vLLM 0.33 map events.

    Args:
        removed: vLLM's `BlockRemoved` wire Struct (kwargs constructor).
        encode: a msgpack encoder's `encode`.
        group_idx: the `group_idx` engined sends.
        medium_names: the wire spelling of each medium.
    """

    __slots__ = ("_encode", "_gpu", "_segments")

    def __init__(
        self,
        removed: Callable[..., Any],
        encode: Callable[[Any], bytes],
        group_idx: int,
        medium_names: dict[Medium, str],
    ) -> None:
        self._encode = encode
        self._segments: dict[Medium, tuple[bytes, bytes]] = {}
        for medium, name in medium_names.items():
            sentinel = removed(block_hashes=[_HASH], medium=name, group_idx=group_idx)
            head, found, tail = encode(sentinel).partition(encode([_HASH]))
            if not found:
                raise RuntimeError(f"no sentinel hash in {encode(sentinel)!r}")
            self._segments[medium] = (head, tail)
        # NOTE: GPU, nearly every event's medium, by identity: no dict lookup.
        self._gpu = self._segments[Medium.GPU]

    def removed(self, ev: BlockRemoved) -> Raw:
        head, tail = self._gpu if ev.medium is _GPU else self._segments[ev.medium]
        hashes = ev.block_hashes
        if len(hashes) != 1:
            return Raw(head + self._encode([wire_hash(h) for h in hashes]) + tail)
        h = hashes[0]
        if not U32_LIMIT <= h < U64_LIMIT:
            h = wire_hash(h)
        return Raw(head + _ONE_HASH + h.to_bytes(8, "big") + tail)
