"""KV-cache events in vLLM's wire formats: the struct trees, the batch encoder, a decoder.

Two formats, one struct family each, because msgspec settles map-vs-array on the class line:

* `"vllm"` (default): vLLM 0.33's `KVCacheEvent(tag=True)` family, copied field for field from
  `vllm/distributed/kv_events.py` 0.33.0 so msgspec produces byte-identical payloads. Events are
  tagged maps (`{"type": "BlockStored", ...}`) inside the positional batch `[ts, events, rank]`.
* `"vllm-array"`: vLLM 0.22/0.23's `array_like` family, for consumers that only read positional
  events (`["BlockStored", ...12 elements]`).

The daemon publishes `[topic, seq_bytes(seq), payload]` per engine pass; `KvEventEncoder` makes
the payload from the core's events, `decode_batch` reads either format back (CLI, tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Literal, TypeAlias

import msgspec
from msgspec import Meta

from engined.core import types as core
from engined.wire.kv_event_bytes import MapBatchWriter
from engined.wire.kv_event_bytes import wire_hash as wire_hash
from engined.wire.protocol_errors import WireError

KvEventFormat = Literal["vllm", "vllm-array"]

# --- frames ---------------------------------------------------------------------------------

# Replay end marker seq: vLLM's `(-1).to_bytes(8, "big", signed=True)`.
REPLAY_END_SEQ: Final = b"\xff" * 8
# What follows the ROUTER envelope `[identity, b""]` to end a replay: empty topic, the end
# seq, empty payload. Consumers stop at the empty payload.
REPLAY_END_FRAMES: Final = (b"", REPLAY_END_SEQ, b"")


def seq_bytes(n: int) -> bytes:
    """The 8-byte big-endian seq frame of message `n` (raises OverflowError outside u64)."""
    return n.to_bytes(8, "big")


def read_seq(frame: bytes) -> int:
    """Parse a replay request's start seq.

    vLLM accepts any length, Dynamo's mocker only 8 bytes; protocol v1 says 8, so anything else
    is refused and the replay socket ignores the request (as vLLM does with malformed ones).
    """
    if len(frame) != 8:
        raise WireError("bad_message", f"replay start seq must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


# --- vLLM 0.33 map format (mirrors vllm/distributed/kv_events.py 0.33.0) -------------------

# vLLM's `ExternalBlockHash`: an int by default, the 32-byte digest when
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. Kept as the union so vLLM's own payloads decode.
ExternalBlockHash: TypeAlias = Annotated[
    int | bytes,
    Meta(description="Block hash; engined always sends an int in [2**32, 2**64)."),
]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch per engine pass that produced events: `[ts, events, data_parallel_rank]`."""

    # NOTE: `omit_defaults` has no effect on array_like structs, so `data_parallel_rank` is
    # always the third element (nil if None); every consumer requires exactly three.
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's tagged events; the tag is the class name under key `"type"`."""


class BlockStored(KVCacheEvent):
    """Blocks became matchable: `token_ids` holds `len(block_hashes) * block_size` tokens.

    `lora_id`, `medium` and `lora_name` are always present (nil when unset); the other
    optional keys are omitted when unset.
    """

    # NOTE: keep all 15 fields of vLLM 0.33 although engined sets the last five only for MTP's
    # lookahead hashes (`lookahead_token_ids`, the last): msgspec
    # writes a map16 header (`de 00 NN`) for a struct with more than 15 fields, whatever the
    # entry count, and vLLM 0.33's bytes carry that header (0.24-0.32 had a fixmap).

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks were evicted from `medium` (vLLM sends one event per evicted block)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the sender was dropped (prefix cache reset)."""


class KVEventBatch(EventBatch):
    """A batch of vLLM 0.33 map events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- vLLM 0.22/0.23 positional format -------------------------------------------------------


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of vLLM 0.23's positional events; element 0 is the tag, every field is present."""

    # NOTE: subclasses set the upstream class name as tag explicitly (ours differ), and
    # `omit_defaults` has no effect on array_like structs, so nil fields are still written.


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    """`["BlockStored", ...]`: the 0.22/0.23 layout, 12 elements with the tag."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    """`["BlockRemoved", block_hashes, medium, group_idx]`."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    """`["AllBlocksCleared"]`."""


class ArrayKVEventBatch(EventBatch):
    """A batch of vLLM 0.23 positional events."""

    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


MapKvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
ArrayKvEvent: TypeAlias = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
WireKvEvent: TypeAlias = MapKvEvent | ArrayKvEvent

# --- encoder --------------------------------------------------------------------------------

_MEDIUM: Final[dict[core.Medium, str]] = {
    core.Medium.GPU: "GPU",
    core.Medium.CPU: "CPU",
    core.Medium.STORAGE: "STORAGE",
}
# engined models one plain attention group, as vLLM reports it for a dense model.
_GROUP_IDX: Final = 0
_SPEC_KIND: Final = "full_attention"


def _parent(h: int | None) -> int | None:
    return None if h is None else wire_hash(h)


def _extra_keys(ev: core.BlockStored) -> list[tuple[Any, ...] | None]:
    # NOTE: one None per block, as vLLM 0.33's KVCacheManager sends it for plain text
    # requests, and a salted request's first block `(salt,)`: our bytes stay vLLM's.
    keys = ev.extra_keys
    return [None] * len(ev.block_hashes) if keys is None else list(keys)


def _map_stored(ev: core.BlockStored) -> BlockStored:
    return BlockStored(
        block_hashes=[wire_hash(h) for h in ev.block_hashes],
        parent_block_hash=_parent(ev.parent_hash),
        token_ids=ev.token_ids,
        block_size=ev.block_size,
        lora_id=ev.lora_id,
        medium=_MEDIUM[ev.medium],
        lora_name=ev.lora_name,
        extra_keys=_extra_keys(ev),
        group_idx=_GROUP_IDX,
        kv_cache_spec_kind=_SPEC_KIND,
        lookahead_token_ids=ev.lookahead_token_ids,
    )


def _map_removed(ev: core.BlockRemoved) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=[wire_hash(h) for h in ev.block_hashes],
        medium=_MEDIUM[ev.medium],
        group_idx=_GROUP_IDX,
    )


def _map_cleared(ev: core.AllBlocksCleared) -> AllBlocksCleared:
    return AllBlocksCleared()


def _array_stored(ev: core.BlockStored) -> ArrayBlockStored:
    return ArrayBlockStored(
        block_hashes=[wire_hash(h) for h in ev.block_hashes],
        parent_block_hash=_parent(ev.parent_hash),
        token_ids=ev.token_ids,
        block_size=ev.block_size,
        lora_id=ev.lora_id,
        medium=_MEDIUM[ev.medium],
        lora_name=ev.lora_name,
        extra_keys=_extra_keys(ev),
        group_idx=_GROUP_IDX,
        kv_cache_spec_kind=_SPEC_KIND,
        kv_cache_spec_sliding_window=None,
    )


def _array_removed(ev: core.BlockRemoved) -> ArrayBlockRemoved:
    return ArrayBlockRemoved(
        block_hashes=[wire_hash(h) for h in ev.block_hashes],
        medium=_MEDIUM[ev.medium],
        group_idx=_GROUP_IDX,
    )


def _array_cleared(ev: core.AllBlocksCleared) -> ArrayAllBlocksCleared:
    return ArrayAllBlocksCleared()


_Converters: TypeAlias = dict[type, Callable[[Any], msgspec.Struct]]

_CONVERTERS: Final[dict[KvEventFormat, _Converters]] = {
    "vllm": {
        core.BlockStored: _map_stored,
        core.BlockRemoved: _map_removed,
        core.AllBlocksCleared: _map_cleared,
    },
    "vllm-array": {
        core.BlockStored: _array_stored,
        core.BlockRemoved: _array_removed,
        core.AllBlocksCleared: _array_cleared,
    },
}


class KvEventEncoder:
    """Encodes one engine pass's KV events as one batch payload; build one per publisher.

    Args:
        fmt: `"vllm"` (vLLM 0.33 map events) or `"vllm-array"` (vLLM 0.23 positional events).
    """

    def __init__(self, fmt: KvEventFormat) -> None:
        if fmt not in _CONVERTERS:
            raise ValueError(f"Unknown KV event format: {fmt!r}")
        self.fmt: KvEventFormat = fmt
        # NOTE: dispatch on the exact type through a dict: cheaper than a `match` over class
        # patterns when a pass carries hundreds of events.
        self._converters: dict[type, Callable[[Any], msgspec.Struct]] = _CONVERTERS[fmt]
        self._encode = msgspec.msgpack.Encoder().encode
        # vLLM 0.33's format: the batch written as bytes (kv_event_bytes), the Structs above
        # its definition.
        self._writer: MapBatchWriter | None = None
        if fmt == "vllm":
            self._writer = MapBatchWriter(
                BlockStored,
                BlockRemoved,
                self._encode,
                _GROUP_IDX,
                _SPEC_KIND,
                _MEDIUM,
                {core.AllBlocksCleared: _map_cleared, core.BlockStored: _map_stored},
            )

    def encode_batch(self, ts: float, events: Sequence[core.KvEvent], dp_rank: int) -> bytes:
        """The payload `[ts, events, dp_rank]` for `events` in order.

        Args:
            ts: wall-clock seconds (vLLM stamps `time.time()` when the batch is built);
                always written as float64.
            events: the core's KV events of one pass.
            dp_rank: the publishing rank, written as `data_parallel_rank`.
        """
        if self._writer is not None:
            batch = events if isinstance(events, list) else list(events)
            return self._writer.encode_batch(float(ts), batch, dp_rank)
        converters = self._converters
        try:
            wire_events = [converters[type(ev)](ev) for ev in events]
        except KeyError as exc:
            raise TypeError(f"Not a core KV event: {exc.args[0]!r}") from None
        return self._encode(EventBatch(float(ts), wire_events, dp_rank))


# --- decoder --------------------------------------------------------------------------------


class DecodedBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A decoded payload; each event is a struct of the family its encoding belongs to.

    Positional like `EventBatch`, so re-encoding a decoded vLLM 0.33 or 0.23 payload gives
    its bytes back.
    """

    ts: float
    events: list[WireKvEvent]
    data_parallel_rank: int | None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_RAW_BATCH_DECODER: Final = msgspec.msgpack.Decoder(_RawBatch)
# msgspec refuses one union of map and array_like structs, so each event is routed by its
# msgpack header to the decoder of its family.
_MAP_EVENT_DECODER: Final = msgspec.msgpack.Decoder(MapKvEvent)
_ARRAY_EVENT_DECODER: Final = msgspec.msgpack.Decoder(ArrayKvEvent)
# First bytes of msgpack arrays: fixarray, array16, array32.
_ARRAY_HEADERS: Final = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode a KV event payload of either format (also mixed, as Dynamo accepts).

    Also reads vLLM 0.24-0.32 map payloads (fixmap headers) and 2-element 0.9.0 batches.

    Raises:
        WireError: `bad_message`, naming the path of the offending value.
    """
    try:
        raw = _RAW_BATCH_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError("bad_message", str(exc)) from None
    events: list[WireKvEvent] = []
    for i, event in enumerate(raw.events):
        data = bytes(event)
        decoder = _ARRAY_EVENT_DECODER if data and data[0] in _ARRAY_HEADERS else _MAP_EVENT_DECODER
        try:
            events.append(decoder.decode(data))
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError("bad_message", _at_event(str(exc), i)) from None
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank)


def _at_event(message: str, index: int) -> str:
    """Re-root a per-event msgspec error path at the event's place in the batch."""
    prefix = f"$[1][{index}]"
    if "`$" in message:
        return message.replace("`$", f"`{prefix}", 1)
    return f"{message} - at `{prefix}`"
