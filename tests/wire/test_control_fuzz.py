"""Whatever bytes arrive, ControlDecoder answers with a message or a WireError, nothing else."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.wire import control
from engined.wire.control import ControlDecoder, WireError
from tests.wire import strategies
from tests.wire._paths import read_golden
from tests.wire.strategies import msgpack_scalars

DECODER = ControlDecoder()
FIELDS = [
    "id",
    "request",
    "request_id",
    "handoff_id",
    "token_ids",
    "max_tokens",
    "output_token_ids",
    "dp_rank",
    "stop_token_ids",
    "min_tokens",
    "cache_salt",
    "vocab_size",
    "excluded_token_ids",
    "worker_id",
]

scalars = msgpack_scalars(text_size=300)
msgpack_values = strategies.msgpack_values(scalars, FIELDS, key_size=20, max_leaves=25)
# Maps shaped like messages, so examples get past the tag into field validation.
message_like = st.fixed_dictionaries(
    {"type": st.sampled_from(control.CLIENT_MESSAGE_TAGS) | st.text(max_size=10)},
    optional={
        name: msgpack_values
        | st.fixed_dictionaries(
            {},
            optional={
                "token_ids": st.lists(st.integers(min_value=-3, max_value=2**33), max_size=4),
                "max_tokens": st.integers(min_value=-3, max_value=2**64 - 1),
                "request_id": st.text(max_size=300),
                "dp_rank": st.integers(min_value=-3, max_value=3),
                "junk": scalars,
            },
        )
        for name in FIELDS
    },
)


def _decode_or_wire_error(body: bytes) -> None:
    try:
        msg = DECODER.decode(body)
    except WireError as exc:
        assert exc.code in ("bad_message", "invalid_request")
        assert exc.message
        return
    # Anything accepted re-encodes and decodes to itself.
    assert DECODER.decode(control.encode_message(msg)) == msg


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes(body: bytes) -> None:
    _decode_or_wire_error(body)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values)
def test_arbitrary_msgpack_objects(value: Any) -> None:
    _decode_or_wire_error(msgspec.msgpack.encode(value))


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(message_like)
def test_message_shaped_maps(value: dict[str, Any]) -> None:
    _decode_or_wire_error(msgspec.msgpack.encode(value))


@settings(max_examples=300)
@given(st.data())
def test_corrupted_valid_messages(data: st.DataObject) -> None:
    body = bytearray(read_golden("engined_control_submit.bin"))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        index = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        body[index] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    _decode_or_wire_error(bytes(body[:cut]))


def test_client_message_tags_cover_the_protocol() -> None:
    """The fuzzer's tag list is derived from the message union: every protocol v1 type."""
    assert control.CLIENT_MESSAGE_TAGS == (
        "hello",
        "submit",
        "cancel",
        "submit_handoff_prefill",
        "release_source",
        "cancel_source",
        "reserve_destination",
        "activate_destination",
        "cancel_destination",
        "stats",
        "reset_prefix_cache",
        "ping",
        "wait_idle",
        "set_vocabulary",
        "set_fpm_worker_id",
        "watch_load",
        "metrics",
        "pause",
        "resume",
        "sleep",
        "wake_up",
        "release_kv_cache_memory",
        "set_weight_version",
    )
