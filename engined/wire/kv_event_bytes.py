"""vLLM 0.33's map-format KV event batch written as bytes, and the block hash the wire carries.

Why bytes: vLLM publishes one `BlockRemoved` per evicted block and one `BlockStored` per
caching call, so under a full pool a pass publishes about one event per four tokens, and
building a wire Struct per event (and a `msgspec.Raw` per event written as bytes) was the
dearest part of the KV path. `MapBatchWriter` writes the batch `[ts, events, rank]` as one
join of byte pieces: each event is its encoding's fixed segments with the values written
between them. The segments are cut, at construction, from the encodings of sentinel events
built with the wire Structs themselves (engined/wire/kv_events.py passes them in), so the
bytes stay msgspec's; tests/wire/test_kv_event_bytes.py holds whole payloads to the Struct
path. Events of other types (`AllBlocksCleared`), and the stores of LoRA requests (rare, and
with fields the sentinel leaves nil), go through their Struct converter.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from engined.core.block_events import BlockRemoved, BlockStored, Medium
from engined.wire.constraints import U32_LIMIT, U64_LIMIT

_REMAP_BIT: Final = 1 << 63
_PACK_U64: Final = struct.Struct(">Q").pack
_PACK_F64: Final = struct.Struct(">d").pack
_PACK_U16: Final = struct.Struct(">H").pack
_PACK_U32: Final = struct.Struct(">I").pack
_UINT64: Final = b"\xcf"  # msgpack's uint64 head: every wire hash is at least 2**32
_ONE_HASH: Final = b"\x91\xcf"  # a one-element array of a uint64
_NIL: Final = b"\xc0"
# Sentinel values, each with an encoding that occurs once in its sentinel event.
_HASH: Final = 0xA1A2A3A4A5A6A7A8
_PARENT: Final = 0xB1B2B3B4B5B6B7B8
_TOKEN: Final = 0xC1C2C3C4
_BLOCK_SIZE: Final = 0xD1D2D3D4
_EXTRA: Final = ("engined-sentinel-extra-keys",)
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


def cut(encoded: bytes, markers: list[bytes]) -> list[bytes]:
    """`encoded` split at each marker in turn: the segments between them."""
    segments: list[bytes] = []
    rest = encoded
    for marker in markers:
        head, found, rest = rest.partition(marker)
        if not found:
            raise RuntimeError(f"no sentinel {marker!r} in {encoded!r}")
        segments.append(head)
    segments.append(rest)
    return segments


def array_head(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + _PACK_U16(n)
    return b"\xdd" + _PACK_U32(n)


class MapBatchWriter:
    """Writes a pass's core KV events as a vLLM 0.33 map-format batch payload.

    Args:
        stored: vLLM's `BlockStored` wire Struct (kwargs constructor).
        removed: vLLM's `BlockRemoved` wire Struct (kwargs constructor).
        encode: a msgpack encoder's `encode`.
        group_idx: the `group_idx` engined sends.
        spec_kind: the `kv_cache_spec_kind` engined sends.
        medium_names: the wire spelling of each medium.
        others: Struct converters of the other core event types, by type, and of a
            `BlockStored` with LoRA fields.
    """

    __slots__ = ("_encode", "_others", "_removed", "_removed_gpu", "_sizes", "_stored")

    def __init__(
        self,
        stored: Callable[..., Any],
        removed: Callable[..., Any],
        encode: Callable[[Any], bytes],
        group_idx: int,
        spec_kind: str,
        medium_names: dict[Medium, str],
        others: dict[type, Callable[[Any], Any]],
    ) -> None:
        self._encode = encode
        self._others = others
        self._sizes: dict[int, bytes] = {}
        # Per medium: (head, head with a one-hash array's head, tail) of a removal; (head,
        # after hashes, after parent, after tokens, after block size, tail) of a store.
        self._removed: dict[Medium, tuple[bytes, bytes, bytes]] = {}
        self._stored: dict[Medium, list[bytes]] = {}
        for medium, name in medium_names.items():
            sentinel = removed(block_hashes=[_HASH], medium=name, group_idx=group_idx)
            head, tail = cut(encode(sentinel), [encode([_HASH])])
            self._removed[medium] = (head, head + _ONE_HASH, tail)
            sentinel = stored(
                block_hashes=[_HASH],
                parent_block_hash=_PARENT,
                token_ids=[_TOKEN],
                block_size=_BLOCK_SIZE,
                lora_id=None,
                medium=name,
                lora_name=None,
                extra_keys=[_EXTRA],
                group_idx=group_idx,
                kv_cache_spec_kind=spec_kind,
            )
            markers = [encode(v) for v in ([_HASH], _PARENT, [_TOKEN], _BLOCK_SIZE, [_EXTRA])]
            self._stored[medium] = cut(encode(sentinel), markers)
        # NOTE: GPU, nearly every event's medium, by identity: no dict lookup.
        self._removed_gpu = self._removed[_GPU]

    def encode_batch(self, ts: float, events: list[Any], dp_rank: int) -> bytes:
        """The payload `[ts, events, dp_rank]`, as msgspec encodes vLLM's `EventBatch`."""
        pieces = [b"\x93\xcb", _PACK_F64(ts), array_head(len(events))]
        append = pieces.append
        for ev in events:
            kind = type(ev)
            if kind is BlockRemoved:
                head, head_one, tail = (
                    self._removed_gpu if ev.medium is _GPU else self._removed[ev.medium]
                )
                hashes = ev.block_hashes
                if len(hashes) == 1:
                    h = hashes[0]
                    if not U32_LIMIT <= h < U64_LIMIT:
                        h = wire_hash(h)
                    append(head_one)
                    append(_PACK_U64(h))
                else:
                    append(head)
                    append(self._encode([wire_hash(h) for h in hashes]))
                append(tail)
            elif kind is BlockStored:
                if ev.lora_id is None and ev.lora_name is None and ev.lookahead_token_ids is None:
                    self._write_stored(ev, pieces)
                else:
                    append(self._encode(self._others[BlockStored](ev)))
            else:
                convert = self._others.get(kind)
                if convert is None:
                    raise TypeError(f"Not a core KV event: {kind!r}")
                append(self._encode(convert(ev)))
        append(self._encode(dp_rank))
        return b"".join(pieces)

    def _write_stored(self, ev: BlockStored, pieces: list[bytes]) -> None:
        head, after_hashes, after_parent, after_tokens, after_size, tail = self._stored[ev.medium]
        append = pieces.append
        encode = self._encode
        hashes = ev.block_hashes
        n = len(hashes)
        append(head)
        if n == 1:
            append(_ONE_HASH + _PACK_U64(wire_hash(hashes[0])))
        else:
            append(encode([wire_hash(h) for h in hashes]))
        append(after_hashes)
        parent = ev.parent_hash
        append(_NIL if parent is None else _UINT64 + _PACK_U64(wire_hash(parent)))
        append(after_parent)
        append(encode(ev.token_ids))
        append(after_tokens)
        size = self._sizes.get(ev.block_size)
        if size is None:
            size = self._sizes[ev.block_size] = encode(ev.block_size)
        append(size)
        append(after_size)
        keys = ev.extra_keys
        if keys is not None:
            append(encode(list(keys)))
        elif n < 16:
            append(bytes((0x90 | n,)) + _NIL * n)
        else:
            append(encode([None] * n))
        append(tail)
