"""`BlockRemoved` written as bytes (engined/wire/kv_event_bytes.py) is the Struct path's bytes.

The encoder of the `vllm` format writes removals from byte segments; the Struct converter
(`_map_removed`) stays the definition. Every shape a removal takes (one hash or several,
hashes needing the remap below 2**32, the edges of u64, each medium, mixed with other
events) must encode to the same payload both ways, and a hash outside u64 must fail alike.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from engined.core import types as core
from engined.wire import kv_events as kv
from engined.wire.kv_event_bytes import RemovedEventBytes
from tests.wire.test_kv_events import CLEARED, TS, removed, stored

U64_EDGES = (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


def struct_payload(events: list[core.KvEvent], dp_rank: int = 0) -> bytes:
    """The payload as the Struct converters alone build it."""
    converters = kv._CONVERTERS["vllm"]
    wire = [converters[type(ev)](ev) for ev in events]
    return msgspec.msgpack.encode(kv.EventBatch(TS, wire, dp_rank))


def random_hashes(rng: random.Random) -> list[int]:
    count = rng.choice((1, 1, 1, 2, 5))
    return [
        rng.choice((rng.choice(U64_EDGES), rng.randrange(2**32), rng.randrange(2**64)))
        for _ in range(count)
    ]


def test_every_removal_encodes_as_its_struct_does() -> None:
    rng = random.Random(25)
    encoder = kv.KvEventEncoder("vllm")
    for _ in range(500):
        events: list[core.KvEvent] = [
            removed(random_hashes(rng), rng.choice(list(core.Medium)))
            for _ in range(rng.randrange(1, 6))
        ]
        if rng.random() < 0.3:
            events.insert(
                rng.randrange(len(events)), stored([rng.randrange(2**64)], None, [1, 2, 3, 4])
            )
        if rng.random() < 0.1:
            events.append(CLEARED)
        rank = rng.randrange(4)
        assert encoder.encode_batch(TS, events, rank) == struct_payload(events, rank)


def test_a_removal_decodes_to_the_remapped_hashes_and_its_medium() -> None:
    payload = kv.KvEventEncoder("vllm").encode_batch(
        TS, [removed([7]), removed([2**40, 3], core.Medium.CPU)], 0
    )
    first, second = kv.decode_batch(payload).events
    assert first == kv.BlockRemoved(block_hashes=[7 | 2**63], medium="GPU", group_idx=0)
    assert second == kv.BlockRemoved(block_hashes=[2**40, 3 | 2**63], medium="CPU", group_idx=0)


@pytest.mark.parametrize("bad", [-1, 2**64, -(2**70)])
def test_a_hash_outside_u64_fails_as_the_struct_path_fails(bad: int) -> None:
    encoder = kv.KvEventEncoder("vllm")
    for hashes in ([bad], [5, bad]):
        with pytest.raises(ValueError, match=f"block hash {bad} is not an unsigned 64-bit int"):
            encoder.encode_batch(TS, [removed(hashes)], 0)
        with pytest.raises(ValueError, match=f"block hash {bad} is not an unsigned 64-bit int"):
            struct_payload([removed(hashes)])


def test_a_struct_without_the_sentinel_hash_is_refused() -> None:
    """Cut from the Struct's own encoding: a Struct that does not carry the hash where the
    writer expects it fails at construction, not with wrong bytes later."""

    class Hashless(msgspec.Struct, tag="BlockRemoved"):
        medium: str | None
        group_idx: int | None = None

    def build(block_hashes: list[int], medium: str, group_idx: int) -> Hashless:
        return Hashless(medium=medium, group_idx=group_idx)

    with pytest.raises(RuntimeError, match="no sentinel hash"):
        RemovedEventBytes(build, msgspec.msgpack.encode, 0, {core.Medium.GPU: "GPU"})
