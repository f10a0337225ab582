"""KV event payloads: vLLM 0.33 / 0.23 byte equality, hash remap, frames, decoding."""

from __future__ import annotations

import msgspec
import pytest

from engined.core import types as core
from engined.wire import kv_events as kv
from engined.wire.protocol_errors import WireError
from tests.wire._paths import read_golden

TS = 1757500000.25
H1 = 0x9D3C5A6E1F2B4C70
H2 = 0x1A2B3C4D5E6F7081


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    *,
    block_size: int = 4,
    medium: core.Medium = core.Medium.GPU,
    extra_keys: list[tuple[str, ...] | None] | None = None,
    lora: tuple[int, str] | None = None,
    lookahead: list[list[int]] | None = None,
) -> core.BlockStored:
    return core.BlockStored(
        event_id=0,
        dp_rank=0,
        parent_hash=parent,
        block_hashes=hashes,
        local_hashes=list(range(len(hashes))),
        token_ids=tokens,
        block_size=block_size,
        medium=medium,
        extra_keys=extra_keys,
        lora_id=None if lora is None else lora[0],
        lora_name=None if lora is None else lora[1],
        lookahead_token_ids=lookahead,
    )


def removed(hashes: list[int], medium: core.Medium = core.Medium.GPU) -> core.BlockRemoved:
    return core.BlockRemoved(event_id=0, dp_rank=0, block_hashes=hashes, medium=medium)


CLEARED = core.AllBlocksCleared(event_id=0, dp_rank=0)


class TestWireHash:
    @pytest.mark.parametrize("h", [2**32, H2, 2**63 - 1, H1, 2**64 - 1])
    def test_wide_hashes_pass_unchanged(self, h: int) -> None:
        assert kv.wire_hash(h) == h

    @pytest.mark.parametrize(
        ("h", "expected"),
        [(0, 2**63), (5, 2**63 + 5), (1001, 2**63 + 1001), (2**32 - 1, 2**63 + 2**32 - 1)],
    )
    def test_narrow_hashes_get_bit_63(self, h: int, expected: int) -> None:
        assert kv.wire_hash(h) == expected

    def test_remap_is_injective_and_lands_in_the_wide_range(self) -> None:
        narrow = [0, 1, 2, 255, 65535, 2**31, 2**32 - 1]
        mapped = [kv.wire_hash(h) for h in narrow]
        assert len(set(mapped)) == len(narrow)
        assert all(2**63 <= m < 2**63 + 2**32 for m in mapped)

    def test_remapped_hash_encodes_as_msgpack_uint64(self) -> None:
        assert msgspec.msgpack.encode(kv.wire_hash(5))[0] == 0xCF

    @pytest.mark.parametrize("h", [-1, -(2**63), 2**64])
    def test_values_outside_u64_are_refused(self, h: int) -> None:
        with pytest.raises(ValueError, match="not an unsigned 64-bit int"):
            kv.wire_hash(h)


class TestFrames:
    def test_seq_is_eight_bytes_big_endian(self) -> None:
        assert kv.seq_bytes(0) == b"\x00" * 8
        assert kv.seq_bytes(41) == bytes.fromhex("0000000000000029")
        assert kv.seq_bytes(2**64 - 1) == b"\xff" * 8

    @pytest.mark.parametrize("n", [-1, 2**64])
    def test_seq_outside_u64_overflows(self, n: int) -> None:
        with pytest.raises(OverflowError):
            kv.seq_bytes(n)

    def test_replay_end_marker_is_vllms(self) -> None:
        assert (-1).to_bytes(8, "big", signed=True) == kv.REPLAY_END_SEQ
        assert kv.REPLAY_END_FRAMES == (b"", b"\xff" * 8, b"")

    def test_read_seq_round_trips(self) -> None:
        assert kv.read_seq(kv.seq_bytes(123456789)) == 123456789

    @pytest.mark.parametrize("frame", [b"", b"\x00" * 7, b"\x00" * 9])
    def test_read_seq_refuses_other_lengths(self, frame: bytes) -> None:
        with pytest.raises(WireError, match="8 bytes") as info:
            kv.read_seq(frame)
        assert info.value.code == "bad_message"


class TestStructsMatchVllm033:
    """Our struct tree encodes vLLM 0.33's captured payloads byte for byte.

    These captures use hand-picked hashes below 2**32 and field sets the encoder never emits,
    so they are rebuilt from the structs directly (no remap, no defaults filled in).
    """

    def test_block_stored_x2_map16_headers(self) -> None:
        batch = kv.KVEventBatch(
            ts=1700000000.0,
            events=[
                kv.BlockStored(
                    block_hashes=[1001, 1002],
                    parent_block_hash=None,
                    token_ids=list(range(100, 108)),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                kv.BlockStored(
                    block_hashes=[1003, 1004],
                    parent_block_hash=1002,
                    token_ids=list(range(108, 116)),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                ),
            ],
            data_parallel_rank=0,
        )
        expected = read_golden("vllm033_reference_block_stored_x2.bin")
        assert msgspec.msgpack.encode(batch) == expected
        # NOTE: 8 and 9 entries, yet map16 (`de 00 NN`): the struct has more than 15 fields.
        assert b"\xde\x00\x08" in expected and b"\xde\x00\x09" in expected

    def test_block_removed(self) -> None:
        batch = kv.KVEventBatch(
            ts=1700000001.0,
            events=[kv.BlockRemoved(block_hashes=[1004], medium="GPU")],
            data_parallel_rank=0,
        )
        assert msgspec.msgpack.encode(batch) == read_golden("vllm033_reference_block_removed.bin")

    def test_all_blocks_cleared(self) -> None:
        batch = kv.KVEventBatch(
            ts=1700000002.0, events=[kv.AllBlocksCleared()], data_parallel_rank=0
        )
        expected = read_golden("vllm033_reference_all_blocks_cleared.bin")
        assert msgspec.msgpack.encode(batch) == expected


class TestEncoderMatchesVllm:
    """KvEventEncoder on core events gives vLLM's bytes for the same content."""

    def test_vllm033_block_stored_with_parent(self) -> None:
        payload = kv.KvEventEncoder("vllm").encode_batch(
            TS, [stored([0xF00DFACECAFEBEEF], H2, [6, 7, 8, 9])], 0
        )
        assert payload == read_golden("vllm033_reference_block_stored_parent.bin")

    def test_vllm033_salted_block_stored(self) -> None:
        """A salted request's first two blocks: the untagged salt on block 0, None on 1."""
        event = stored(
            [H1, H2], None, [128000, 9125, 271, 1, 2, 3, 4, 5], extra_keys=[("tenant-a",), None]
        )
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [event], 0)
        assert payload == read_golden("vllm033_reference_block_stored_salted.bin")

    def test_vllm033_lora_block_stored(self) -> None:
        """A salted LoRA request's blocks: `lora_id` and `lora_name` set, and the adapter's
        name before the salt in block 0's untagged extra keys, alone in block 1's."""
        event = stored(
            [H1, H2],
            None,
            [128000, 9125, 271, 1, 2, 3, 4, 5],
            extra_keys=[("sql-lora", "tenant-a"), ("sql-lora",)],
            lora=(3, "sql-lora"),
        )
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [event], 0)
        assert payload == read_golden("vllm033_reference_block_stored_lora.bin")

    def test_vllm033_lookahead_block_stored(self) -> None:
        """MTP with prefix caching: each block's hash covers the token after it, which the
        event carries in `lookahead_token_ids` (the struct path: the byte writer has no
        segment for it)."""
        event = stored([H1, H2], None, [128000, 9125, 271, 1, 2, 3, 4, 5], lookahead=[[2], [77]])
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [event], 0)
        assert payload == read_golden("vllm033_reference_block_stored_lookahead.bin")

    def test_lora_and_plain_stores_in_one_batch_keep_their_order(self) -> None:
        plain = stored([H2], H1, [1, 2, 3, 4])
        lora = stored([H1], None, [5, 6, 7, 8], extra_keys=[("a",)], lora=(1, "a"))
        batch = kv.decode_batch(
            kv.KvEventEncoder("vllm").encode_batch(TS, [plain, lora, removed([H1])], 0)
        )
        first, second, third = batch.events
        assert isinstance(first, kv.BlockStored) and isinstance(second, kv.BlockStored)
        assert (first.lora_id, first.lora_name, first.block_hashes) == (None, None, [H2])
        assert (second.lora_id, second.lora_name, second.extra_keys) == (1, "a", [("a",)])
        assert isinstance(third, kv.BlockRemoved)

    def test_vllm023_positional_lora_block_stored(self) -> None:
        event = stored([H1], None, [1, 2, 3, 4], extra_keys=[("a",)], lora=(7, "a"))
        batch = kv.decode_batch(kv.KvEventEncoder("vllm-array").encode_batch(TS, [event], 0))
        (wire,) = batch.events
        assert isinstance(wire, kv.ArrayBlockStored)
        assert (wire.lora_id, wire.lora_name, wire.extra_keys) == (7, "a", [("a",)])

    def test_vllm023_positional_salted_block_stored(self) -> None:
        event = stored([H1], None, [1, 2, 3, 4], extra_keys=[("tenant-a",)])
        batch = kv.decode_batch(kv.KvEventEncoder("vllm-array").encode_batch(TS, [event], 0))
        (wire,) = batch.events
        assert isinstance(wire, kv.ArrayBlockStored)
        assert wire.extra_keys == [("tenant-a",)]

    def test_vllm033_all_blocks_cleared(self) -> None:
        payload = kv.KvEventEncoder("vllm").encode_batch(1700000002.0, [CLEARED], 0)
        assert payload == read_golden("vllm033_reference_all_blocks_cleared.bin")

    def test_removed_and_cleared_as_vllm_024_to_033_send_them(self) -> None:
        # BlockRemoved has 5 fields in 0.33 (a fixmap, like 0.24-0.32), so these bytes hold.
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [removed([H2]), CLEARED], 0)
        assert payload == read_golden("vllm024_032_reference_removed_cleared.bin")

    def test_vllm023_positional_block_stored(self) -> None:
        event = stored([H1, H2], None, [128000, 9125, 271, 1, 2, 3, 4, 5])
        payload = kv.KvEventEncoder("vllm-array").encode_batch(TS, [event], 0)
        assert payload == read_golden("vllm023_reference_block_stored.bin")

    def test_vllm023_positional_removed_and_cleared(self) -> None:
        payload = kv.KvEventEncoder("vllm-array").encode_batch(TS, [removed([H2]), CLEARED], 0)
        assert payload == read_golden("vllm023_reference_removed_cleared.bin")


class TestEncoder:
    @pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
    def test_hashes_are_remapped_everywhere(self, fmt: kv.KvEventFormat) -> None:
        events: list[core.KvEvent] = [stored([7, H1], 3, list(range(8))), removed([7, H2])]
        batch = kv.decode_batch(kv.KvEventEncoder(fmt).encode_batch(TS, events, 0))
        first, second = batch.events
        assert isinstance(first, kv.BlockStored | kv.ArrayBlockStored)
        assert first.block_hashes == [2**63 + 7, H1]
        assert first.parent_block_hash == 2**63 + 3
        assert isinstance(second, kv.BlockRemoved | kv.ArrayBlockRemoved)
        assert second.block_hashes == [2**63 + 7, H2]

    @pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
    @pytest.mark.parametrize(
        ("medium", "spelled"),
        [(core.Medium.GPU, "GPU"), (core.Medium.CPU, "CPU"), (core.Medium.STORAGE, "STORAGE")],
    )
    def test_medium_spelling(
        self, fmt: kv.KvEventFormat, medium: core.Medium, spelled: str
    ) -> None:
        events: list[core.KvEvent] = [
            stored([H1], None, [1, 2, 3, 4], medium=medium),
            removed([H1], medium),
        ]
        batch = kv.decode_batch(kv.KvEventEncoder(fmt).encode_batch(TS, events, 0))
        assert [getattr(ev, "medium", None) for ev in batch.events] == [spelled, spelled]

    def test_vllm_block_stored_keys_in_vllm_order(self) -> None:
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [stored([H1], None, [1, 2])], 0)
        (event,) = msgspec.msgpack.decode(payload)[1]
        assert list(event) == [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ]
        assert event["extra_keys"] == [None]
        assert payload.find(b"\xde\x00\x0b") == 11  # right after ts and the events header

    def test_vllm_block_removed_keys(self) -> None:
        payload = kv.KvEventEncoder("vllm").encode_batch(TS, [removed([H1])], 0)
        (event,) = msgspec.msgpack.decode(payload)[1]
        assert event == {
            "type": "BlockRemoved",
            "block_hashes": [H1],
            "medium": "GPU",
            "group_idx": 0,
        }

    def test_array_lengths_are_vllm_023s(self) -> None:
        events: list[core.KvEvent] = [
            stored([H1, H2], None, list(range(8))),
            removed([H1]),
            CLEARED,
        ]
        payload = kv.KvEventEncoder("vllm-array").encode_batch(TS, events, 0)
        assert [len(ev) for ev in msgspec.msgpack.decode(payload)[1]] == [12, 4, 1]

    @pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
    def test_batch_envelope(self, fmt: kv.KvEventFormat) -> None:
        encoder = kv.KvEventEncoder(fmt)
        payload = encoder.encode_batch(1700000000, [], 3)  # an int ts still goes out as float64
        assert payload == bytes.fromhex("93cb41d954fc40000000" + "90" + "03")
        assert encoder.fmt == fmt

    def test_token_ids_pass_through(self) -> None:
        tokens = [0, 2**32 - 1, 128000, 5]
        batch = kv.decode_batch(
            kv.KvEventEncoder("vllm").encode_batch(TS, [stored([H1], None, tokens)], 0)
        )
        (event,) = batch.events
        assert isinstance(event, kv.BlockStored)
        assert event.token_ids == tokens
        assert event.block_size == 4

    def test_unknown_format_is_refused(self) -> None:
        with pytest.raises(ValueError, match="Unknown KV event format: 'vllm-map'"):
            kv.KvEventEncoder("vllm-map")  # type: ignore[arg-type]

    def test_non_core_event_is_refused(self) -> None:
        with pytest.raises(TypeError, match="Not a core KV event"):
            kv.KvEventEncoder("vllm").encode_batch(TS, [kv.AllBlocksCleared()], 0)  # type: ignore[list-item]


REFERENCES_REENCODED_EXACTLY = [
    "vllm033_reference_block_stored_x2.bin",
    "vllm033_reference_block_removed.bin",
    "vllm033_reference_all_blocks_cleared.bin",
    "vllm033_reference_block_stored_parent.bin",
    "vllm033_reference_block_stored_salted.bin",
    "vllm033_reference_block_stored_lora.bin",
    "vllm033_reference_block_stored_lookahead.bin",
    "vllm024_032_reference_removed_cleared.bin",
    "vllm023_reference_block_stored.bin",
    "vllm023_reference_removed_cleared.bin",
]


class TestDecoder:
    @pytest.mark.parametrize("name", REFERENCES_REENCODED_EXACTLY)
    def test_vllm_payloads_decode_and_reencode_to_the_same_bytes(self, name: str) -> None:
        payload = read_golden(name)
        assert msgspec.msgpack.encode(kv.decode_batch(payload)) == payload

    def test_vllm_024_032_fixmap_header_decodes(self) -> None:
        batch = kv.decode_batch(read_golden("vllm024_032_reference_block_stored.bin"))
        positional = kv.decode_batch(read_golden("vllm023_reference_block_stored.bin"))
        (event,), (array_event,) = batch.events, positional.events
        assert isinstance(event, kv.BlockStored)
        assert isinstance(array_event, kv.ArrayBlockStored)
        assert msgspec.structs.asdict(event) == {
            **msgspec.structs.asdict(array_event),
            "locality": None,
            "ownership": None,
            "session_id": None,
            "lookahead_token_ids": None,
        }

    def test_mixed_formats_in_one_batch(self) -> None:
        payload = msgspec.msgpack.encode(
            [TS, [kv.ArrayAllBlocksCleared(), kv.AllBlocksCleared()], 2]
        )
        batch = kv.decode_batch(payload)
        assert batch.events == [kv.ArrayAllBlocksCleared(), kv.AllBlocksCleared()]
        assert batch.data_parallel_rank == 2

    def test_two_element_batch_of_vllm_090(self) -> None:
        batch = kv.decode_batch(msgspec.msgpack.encode([1.5, []]))
        assert batch == kv.DecodedBatch(1.5, [], None)

    @pytest.mark.parametrize(
        ("payload", "match"),
        [
            (b"\xc1", "malformed"),
            (msgspec.msgpack.encode({"ts": 1.0}), "Expected `array`, got `object`"),
            (
                msgspec.msgpack.encode([TS, [5], 0]),
                r"Expected `object`, got `int` - at `\$\[1\]\[0\]`",
            ),
            (
                msgspec.msgpack.encode([TS, [{"type": "BlockFrozen"}], 0]),
                r"Invalid value 'BlockFrozen' - at `\$\[1\]\[0\]\.type`",
            ),
            (
                msgspec.msgpack.encode(
                    [TS, [{"type": "AllBlocksCleared"}, {"type": "BlockRemoved"}], 0]
                ),
                r"missing required field `block_hashes` - at `\$\[1\]\[1\]`",
            ),
            (
                msgspec.msgpack.encode([TS, [["BlockRemoved", "x", "GPU"]], 0]),
                r"Expected `array`, got `str` - at `\$\[1\]\[0\]\[1\]`",
            ),
        ],
    )
    def test_malformed_payloads(self, payload: bytes, match: str) -> None:
        with pytest.raises(WireError, match=match) as info:
            kv.decode_batch(payload)
        assert info.value.code == "bad_message"


ROUND_TRIP_STRUCTS: list[msgspec.Struct] = [
    kv.BlockStored(
        block_hashes=[H1],
        parent_block_hash=H2,
        token_ids=[1, 2],
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("adapter", "salt")],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="owned",
        session_id="s",
        lookahead_token_ids=[[3, 4]],
    ),
    kv.BlockRemoved(block_hashes=[H1, b"\x01" * 32], medium=None, group_idx=0, locality="LOCAL"),
    kv.AllBlocksCleared(),
    kv.ArrayBlockStored(
        block_hashes=[H1],
        parent_block_hash=None,
        token_ids=[1],
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    ),
    kv.ArrayBlockRemoved(block_hashes=[H2], medium="GPU", group_idx=0),
    kv.ArrayAllBlocksCleared(),
    kv.KVEventBatch(ts=TS, events=[kv.AllBlocksCleared()], data_parallel_rank=1),
    kv.ArrayKVEventBatch(ts=TS, events=[kv.ArrayAllBlocksCleared()], data_parallel_rank=None),
    kv.DecodedBatch(TS, [kv.AllBlocksCleared(), kv.ArrayAllBlocksCleared()], 0),
]


def _decode_as(payload: bytes, value: msgspec.Struct) -> object:
    if isinstance(value, kv.DecodedBatch):  # its events union has no single msgspec decoder
        return kv.decode_batch(payload)
    return msgspec.msgpack.decode(payload, type=type(value))


@pytest.mark.parametrize("value", ROUND_TRIP_STRUCTS, ids=lambda v: type(v).__name__)
def test_struct_round_trip(value: msgspec.Struct) -> None:
    assert _decode_as(msgspec.msgpack.encode(value), value) == value
