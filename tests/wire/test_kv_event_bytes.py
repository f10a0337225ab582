"""vLLM 0.33 batches written as bytes (engined/wire/kv_event_bytes.py) are the Struct path's.

The encoder of the `vllm` format writes a pass's batch from byte segments; the Struct
converters (`_map_stored`, `_map_removed`, `_map_cleared`) and msgspec's encoding of
`EventBatch` stay the definition. Every shape an event takes (one hash or several, hashes
needing the remap below 2**32, the edges of u64, a root or a parent, each medium, salted
extra keys, block sizes across msgpack's int widths), every batch length across msgpack's
array headers, and every rank must encode to the same payload both ways, and a hash outside
u64 must fail alike.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from engined.core import types as core
from engined.wire import kv_events as kv
from engined.wire.kv_event_bytes import MapBatchWriter
from tests.wire.test_kv_events import CLEARED, TS, removed, stored

U64_EDGES = (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


def struct_payload(events: list[core.KvEvent], dp_rank: int = 0, ts: float = TS) -> bytes:
    """The payload as the Struct converters alone build it."""
    converters = kv._CONVERTERS["vllm"]
    wire = [converters[type(ev)](ev) for ev in events]
    return msgspec.msgpack.encode(kv.EventBatch(ts, wire, dp_rank))


def random_hash(rng: random.Random) -> int:
    return rng.choice((rng.choice(U64_EDGES), rng.randrange(2**32), rng.randrange(2**64)))


def random_hashes(rng: random.Random) -> list[int]:
    return [random_hash(rng) for _ in range(rng.choice((1, 1, 1, 2, 5, 17)))]


def random_stored(rng: random.Random) -> core.BlockStored:
    hashes = random_hashes(rng)
    block_size = rng.choice((1, 4, 16, 127, 128, 255, 256, 65536))
    tokens = [rng.choice((0, 7, 200, 70000, 2**32 - 1)) for _ in range(len(hashes) * 2)]
    extra: list[tuple[str, ...] | None] | None = None
    if rng.random() < 0.2:
        extra = [("salt-" + str(rng.randrange(100)),), *[None] * (len(hashes) - 1)]
    return stored(
        hashes,
        rng.choice((None, random_hash(rng))),
        tokens,
        block_size=block_size,
        medium=rng.choice(list(core.Medium)),
        extra_keys=extra,
    )


def random_event(rng: random.Random) -> core.KvEvent:
    roll = rng.random()
    if roll < 0.05:
        return CLEARED
    if roll < 0.45:
        return random_stored(rng)
    return removed(random_hashes(rng), rng.choice(list(core.Medium)))


def test_every_batch_encodes_as_its_structs_do() -> None:
    rng = random.Random(25)
    encoder = kv.KvEventEncoder("vllm")
    for _ in range(600):
        events = [random_event(rng) for _ in range(rng.choice((0, 1, 3, 15, 16, 40)))]
        rank = rng.randrange(200)
        ts = rng.choice((TS, 0.0, -1.5, 1e300))
        assert encoder.encode_batch(ts, events, rank) == struct_payload(events, rank, ts)


@pytest.mark.parametrize("count", [15, 16, 65535, 65536])
def test_a_batch_of_any_length_gets_msgpacks_array_head(count: int) -> None:
    events: list[core.KvEvent] = [removed([2**40 + i]) for i in range(count)]
    assert kv.KvEventEncoder("vllm").encode_batch(TS, events, 3) == struct_payload(events, 3)


def test_a_tuple_of_events_encodes_as_the_list() -> None:
    events: list[core.KvEvent] = [removed([5]), stored([2**40], None, [1, 2, 3, 4])]
    encoder = kv.KvEventEncoder("vllm")
    assert encoder.encode_batch(TS, tuple(events), 0) == struct_payload(events)


def test_a_removal_decodes_to_the_remapped_hashes_and_its_medium() -> None:
    payload = kv.KvEventEncoder("vllm").encode_batch(
        TS, [removed([7]), removed([2**40, 3], core.Medium.CPU)], 0
    )
    first, second = kv.decode_batch(payload).events
    assert first == kv.BlockRemoved(block_hashes=[7 | 2**63], medium="GPU", group_idx=0)
    assert second == kv.BlockRemoved(block_hashes=[2**40, 3 | 2**63], medium="CPU", group_idx=0)


def test_a_store_decodes_to_its_struct() -> None:
    event = stored([5, 2**40], 9, [1, 2, 3, 4, 5, 6, 7, 8], extra_keys=[("s",), None])
    (decoded,) = kv.decode_batch(kv.KvEventEncoder("vllm").encode_batch(TS, [event], 0)).events
    assert decoded == kv.BlockStored(
        block_hashes=[5 | 2**63, 2**40],
        parent_block_hash=9 | 2**63,
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("s",), None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


@pytest.mark.parametrize("bad", [-1, 2**64, -(2**70)])
def test_a_hash_outside_u64_fails_as_the_struct_path_fails(bad: int) -> None:
    encoder = kv.KvEventEncoder("vllm")
    cases: list[core.KvEvent] = [
        removed([bad]),
        removed([5, bad]),
        stored([bad], None, [1, 2, 3, 4]),
        stored([2**40, bad], None, [1] * 8),
        stored([2**40], bad, [1, 2, 3, 4]),
    ]
    for event in cases:
        with pytest.raises(ValueError, match=f"block hash {bad} is not an unsigned 64-bit int"):
            encoder.encode_batch(TS, [event], 0)
        with pytest.raises(ValueError, match=f"block hash {bad} is not an unsigned 64-bit int"):
            struct_payload([event])


def test_a_struct_without_a_sentinel_is_refused() -> None:
    """Cut from the Structs' own encodings: a Struct that does not carry a value where the
    writer expects it fails at construction, not with wrong bytes later."""

    class Hashless(msgspec.Struct, tag="BlockRemoved"):
        medium: str | None
        group_idx: int | None = None

    def build(block_hashes: list[int], medium: str, group_idx: int) -> Hashless:
        return Hashless(medium=medium, group_idx=group_idx)

    with pytest.raises(RuntimeError, match="no sentinel"):
        MapBatchWriter(
            kv.BlockStored,
            build,
            msgspec.msgpack.encode,
            0,
            "full_attention",
            {core.Medium.GPU: "GPU"},
            {},
        )
