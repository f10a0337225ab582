"""What an error echoes of its input is bounded, and its `id` is found whenever readable
(issue 10, defects 8 and 9).

1. A 16 MiB unknown key, a 100 kB unknown `type`, a huge quote-free message: the message
   keeps at most ECHO_MAX_BYTES of each quoted input and MESSAGE_MAX_BYTES in all, says
   `…(truncated, N bytes)` with the input's size, and still names the field's path.
2. Invalid UTF-8 anywhere but in the id, a message cut short or broken after its id, one
   nested too deeply after its id: the id is echoed. Invalid UTF-8 in the id itself, damage
   before it, or more than SCAN_BUDGET items before it in a broken message: no id.
3. Whatever the bytes, the probe returns an id or None and raises nothing.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engined.wire.control import ControlDecoder, ReplyDecoder, WireError
from engined.wire.probe import SCAN_BUDGET, probe_id
from engined.wire.protocol_errors import (
    ECHO_MAX_BYTES,
    MESSAGE_MAX_BYTES,
    bound_message,
    truncate_utf8,
)

DECODER = ControlDecoder()
encode = msgspec.msgpack.encode
# "…(truncated, 16777216 bytes)" and the like: the marker's own bytes on top of a bound.
MARKER_MAX = len("…(truncated, 18446744073709551616 bytes)".encode())


def fixstr(raw: bytes) -> bytes:
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def refused(body: bytes) -> WireError:
    with pytest.raises(WireError) as info:
        DECODER.decode(body)
    return info.value


def utf8_len(text: str) -> int:
    return len(text.encode())


class TestEchoIsBounded:
    def test_a_16_mib_unknown_key(self) -> None:
        key = "k" * (16 << 20)
        err = refused(encode({"type": "ping", key: 1, "id": 9}))
        assert err.code == "bad_message"
        assert err.message_id == 9
        assert utf8_len(err.message) <= ECHO_MAX_BYTES + MARKER_MAX + 64
        assert err.message.startswith("Object contains unknown field `" + "k" * ECHO_MAX_BYTES)
        assert f"…(truncated, {16 << 20} bytes)`" in err.message

    def test_a_long_nested_unknown_key_keeps_its_path(self) -> None:
        body = encode(
            {"type": "submit", "request": {"token_ids": [1], "max_tokens": 1, "é" * 1000: 0}}
        )
        err = refused(body)
        assert err.message.endswith("…(truncated, 2000 bytes)` - at `$.request`"), err.message
        # Cut between characters, never inside one.
        assert err.message.count("é") == ECHO_MAX_BYTES // 2

    def test_a_long_unknown_type(self) -> None:
        err = refused(encode({"type": "x" * 100_000, "id": "q"}))
        assert err.message_id == "q"
        assert err.message.endswith("…(truncated, 100000 bytes)' - at `$.type`"), err.message

    def test_a_message_quoting_nothing_is_capped_whole(self) -> None:
        err = WireError("bad_message", "y" * 1_000_000)
        assert utf8_len(err.message) <= MESSAGE_MAX_BYTES + MARKER_MAX
        assert err.message.endswith("…(truncated, 1000000 bytes)")
        assert str(err) == err.message

    def test_short_messages_are_untouched(self) -> None:
        text = "Object contains unknown field `colour` - at `$.request`"
        assert bound_message(text) == text
        assert refused(encode({"type": "ping", "colour": 1})).message == (
            "Object contains unknown field `colour`"
        )

    def test_the_reply_decoder_is_bounded_too(self) -> None:
        with pytest.raises(WireError) as info:
            ReplyDecoder().decode(encode({"type": "z" * 50_000}))
        assert utf8_len(info.value.message) <= MESSAGE_MAX_BYTES + MARKER_MAX

    @given(st.text(max_size=2000))
    def test_bounding_twice_changes_nothing(self, text: str) -> None:
        once = bound_message(text)
        assert bound_message(once) == once
        assert utf8_len(once) <= MESSAGE_MAX_BYTES + MARKER_MAX

    def test_a_forged_marker_does_not_escape_the_bound(self) -> None:
        forged = "z" * 100 + "…(truncated, " + "9" * 100_000 + " bytes)"
        assert utf8_len(bound_message(forged)) <= MESSAGE_MAX_BYTES + MARKER_MAX

    @given(st.text(max_size=400), st.integers(min_value=0, max_value=300))
    def test_truncation_keeps_a_whole_character_prefix(self, text: str, limit: int) -> None:
        cut = truncate_utf8(text, limit)
        if utf8_len(text) <= limit:
            assert cut == text
        else:
            kept, marker = cut.rsplit("…(truncated, ", 1)
            assert text.startswith(kept)
            assert utf8_len(kept) <= limit
            assert marker == f"{utf8_len(text)} bytes)"


class TestIdIsFound:
    @pytest.mark.parametrize(
        "body",
        [
            # In the `type` value, a nested request id, an unknown key, a key of `request`.
            b"\x82" + fixstr(b"type") + fixstr(b"pi\xff") + fixstr(b"id") + b"\x05",
            b"\x83"
            + fixstr(b"type")
            + fixstr(b"submit")
            + fixstr(b"request")
            + b"\x81"
            + fixstr(b"request_id")
            + fixstr(b"\xfe\xff")
            + fixstr(b"id")
            + b"\x05",
            b"\x82" + fixstr(b"\xc3\x28") + b"\x01" + fixstr(b"id") + b"\x05",
            b"\x83"
            + fixstr(b"type")
            + fixstr(b"submit")
            + fixstr(b"request")
            + b"\x81"
            + fixstr(b"\xed\xa0\x80")
            + b"\x01"
            + fixstr(b"id")
            + b"\x05",
        ],
        ids=["type", "request_id", "key", "request-key"],
    )
    def test_invalid_utf8_elsewhere(self, body: bytes) -> None:
        err = refused(body)
        assert err.code == "bad_message"
        assert err.message_id == 5

    def test_a_string_id_beside_invalid_utf8(self) -> None:
        body = b"\x82" + fixstr(b"id") + fixstr(b"req-7") + fixstr(b"type") + fixstr(b"\xff")
        assert refused(body).message_id == "req-7"

    @pytest.mark.parametrize(
        "tail",
        [
            b"\x81",  # cut short inside `request`
            b"\xc1",  # a byte msgpack never uses
            b"\xdb\xff\xff\xff\xff",  # a string longer than the message
        ],
    )
    def test_damage_after_the_id(self, tail: bytes) -> None:
        body = b"\x83" + fixstr(b"id") + b"\xcd\x01\x00" + fixstr(b"type") + fixstr(b"submit")
        body += fixstr(b"request") + tail
        assert refused(body).message_id == 256

    def test_a_non_string_key_before_the_damage(self) -> None:
        body = b"\x83" + fixstr(b"id") + b"\x09" + fixstr(b"type") + fixstr(b"submit") + b"\x81"
        assert refused(body).message_id == 9

    def test_nesting_too_deep_after_the_id(self) -> None:
        body = b"\x82" + fixstr(b"id") + b"\x04" + fixstr(b"type") + b"\x91" * 100_000
        assert refused(body).message_id == 4

    @pytest.mark.parametrize(
        "body",
        [
            b"\x82" + fixstr(b"id") + fixstr(b"\xff") + fixstr(b"type") + fixstr(b"ping"),
            b"\x82" + fixstr(b"type") + b"\xc1" + fixstr(b"id") + b"\x05",
            b"\x82" + fixstr(b"id") + b"\xc1",
            b"\x92" + fixstr(b"id") + b"\x05",
            b"",
        ],
        ids=["invalid-id", "damage-before", "damaged-id", "array", "empty"],
    )
    def test_no_id_when_unreadable(self, body: bytes) -> None:
        assert refused(body).message_id is None

    def test_the_scan_gives_up_after_its_budget(self) -> None:
        items = encode(list(range(SCAN_BUDGET)))
        near = b"\x83" + fixstr(b"a") + encode(list(range(SCAN_BUDGET - 10)))
        near += fixstr(b"id") + b"\x03" + fixstr(b"type") + b"\xc1"
        far = b"\x83" + fixstr(b"a") + items + fixstr(b"id") + b"\x03" + fixstr(b"type") + b"\xc1"
        assert refused(near).message_id == 3
        assert refused(far).message_id is None

    def test_an_over_long_id_is_not_echoed(self) -> None:
        body = b"\x82" + fixstr(b"id") + encode("i" * 129) + fixstr(b"type") + b"\xc1"
        assert refused(body).message_id is None


@given(st.binary(max_size=200))
def test_the_probe_never_raises(body: bytes) -> None:
    found = probe_id(body)
    assert found is None or isinstance(found, int | str)


@given(
    st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text(max_size=32),
    st.binary(max_size=60),
)
def test_an_id_before_the_damage_is_always_found(message_id: int | str, tail: bytes) -> None:
    body = b"\x83" + fixstr(b"id") + encode(message_id) + fixstr(b"type") + b"\xc1" + tail
    assert refused(body).message_id == message_id
