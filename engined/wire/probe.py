"""Read the `id` of a client message that failed to decode, so its `error` can echo it.

The contract (PROTOCOL.md §1.2) promises the id back whenever it can still be read. Two
readers, cheapest first:

1. A msgspec decoder of a struct holding only `id`: it skips every other key in C, and does
   not validate the strings it skips, so invalid UTF-8 or a wrong type elsewhere in the
   message does not hide the id.
2. When that fails (the message is not whole msgpack: truncated, a reserved byte; or msgspec
   stopped at a non-string key first), a scan of the top-level map that walks the pairs in
   order and stops at the first `id` key, so an id written before the damage is still
   found. The scan skips values without decoding them, visits at most SCAN_BUDGET msgpack
   items, and never recurses, so a hostile message cannot make it costly.
"""

from __future__ import annotations

from typing import Final

import msgspec

from engined.wire.constraints import MessageId

# The most msgpack items (keys, values, container elements) the fallback scan visits.
SCAN_BUDGET: Final = 4096

_ID_KEY: Final = b"id"


class _IdProbe(msgspec.Struct):
    id: MessageId | None = None


_PROBE: Final = msgspec.msgpack.Decoder(_IdProbe)
_ID_VALUE: Final = msgspec.msgpack.Decoder(MessageId)


class _Unreadable(Exception):
    """The scan met damage, or its budget ran out, before it found the id."""


def probe_id(body: bytes | bytearray | memoryview) -> int | str | None:
    """The message's top-level `id` (int or str, constraints checked), or None.

    The caller still checks the byte limit of a string id.
    """
    try:
        return _PROBE.decode(body).id
    except (msgspec.DecodeError, RecursionError):
        # NOTE: ValidationError included: msgspec may meet a non-string key, say, before the
        # damage that makes the message unreadable as a whole; the scan sorts that out.
        pass
    try:
        return _scan_id(memoryview(body).cast("B"))
    except (_Unreadable, IndexError):
        return None


def _scan_id(buf: memoryview) -> int | str | None:
    head = buf[0]
    if 0x80 <= head <= 0x8F:
        pairs, pos = head & 0x0F, 1
    elif head == 0xDE:
        pairs, pos = _uint(buf, 1, 2), 3
    elif head == 0xDF:
        pairs, pos = _uint(buf, 1, 4), 5
    else:
        return None
    budget = SCAN_BUDGET
    for _ in range(pairs):
        key_start = pos
        pos, budget = _skip(buf, pos, budget)
        value_start = pos
        pos, budget = _skip(buf, pos, budget)
        if _is_id_key(buf[key_start:value_start]):
            try:
                return _ID_VALUE.decode(buf[value_start:pos])
            except msgspec.DecodeError:
                return None
    return None


def _is_id_key(key: memoryview) -> bool:
    # fixstr of length 2 is the only encoding msgpack writers use for "id"; accept str8 too.
    return bytes(key) in (b"\xa2" + _ID_KEY, b"\xd9\x02" + _ID_KEY)


def _uint(buf: memoryview, pos: int, size: int) -> int:
    if pos + size > len(buf):
        raise _Unreadable
    return int.from_bytes(buf[pos : pos + size], "big")


# Fixed-size payloads after a type byte: nil, bools, floats, ints, fixext (type + data).
_FIXED: Final = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8,
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# Length-prefixed payloads: the size of the length, and the extra ext type byte.
_SIZED: Final = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str
}  # fmt: skip
# Containers: the size of the count, and items per counted element (2 for a map's pairs).
_CONTAINERS: Final = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _skip(buf: memoryview, pos: int, budget: int) -> tuple[int, int]:
    """The position after the value at `pos`, and the budget left; iterative."""
    pending = 1
    end = len(buf)
    while pending:
        pending -= 1
        budget -= 1
        if budget < 0 or pos >= end:
            raise _Unreadable
        b = buf[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F:
            pending += 2 * (b & 0x0F)
        elif b <= 0x9F:
            pending += b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            size, extra = _SIZED[b]
            pos += size + extra + _uint(buf, pos, size)
        elif b in _CONTAINERS:
            size, per = _CONTAINERS[b]
            pending += per * _uint(buf, pos, size)
            pos += size
        else:  # 0xC1, never used
            raise _Unreadable
    if pos > end:
        raise _Unreadable
    return pos, budget
