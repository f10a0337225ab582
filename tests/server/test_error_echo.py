"""A real daemon's errors echo a bounded part of the input, and the id whenever readable
(issue 10, defects 8 and 9).

1. An 8 MiB unknown key (within the default daemon's 11 MiB message limit): the `error` reply
   is under 1 kB, names the key's first bytes and its size, and echoes the id; the daemon's
   log line for it is under 2 kB.
2. Invalid UTF-8 in the `type` value, in a nested `request_id` and in a key: each `error`
   carries the message's id; a message cut short after its id too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engined.wire.control import ErrorReply, ReplyDecoder
from tests.server.daemon_harness import start_daemon

WAIT_S = 10.0


def fixstr(raw: bytes) -> bytes:
    return bytes([0xA0 | len(raw)]) + raw


async def exchange(endpoint: str, bodies: list[bytes]) -> list[bytes]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        replies = []
        for body in bodies:
            await sock.send(body)
            replies.append(await asyncio.wait_for(sock.recv(), WAIT_S))
        return replies
    finally:
        sock.close()
        ctx.term()


def test_errors_are_bounded_and_keep_their_id(tmp_path: Path) -> None:
    huge_key = "K" * (8 << 20)
    bodies = [
        msgspec.msgpack.encode({"type": "ping", huge_key: 1, "id": 41}),
        b"\x82" + fixstr(b"type") + fixstr(b"pi\xff") + fixstr(b"id") + b"\x2a",
        b"\x83"
        + fixstr(b"type")
        + fixstr(b"submit")
        + fixstr(b"request")
        + b"\x82"
        + fixstr(b"request_id")
        + fixstr(b"\xc3\x28")
        + fixstr(b"token_ids")
        + b"\x91\x01"
        + fixstr(b"id")
        + fixstr(b"id-43"),
        b"\x82" + fixstr(b"\xe2\x28\xa1") + b"\x01" + fixstr(b"id") + b"\x2c",
        b"\x83" + fixstr(b"id") + b"\x2d" + fixstr(b"type") + fixstr(b"submit") + b"\xa7req",
    ]
    with start_daemon(tmp_path, "--speedup-ratio", "0") as daemon:
        raw = asyncio.run(asyncio.wait_for(exchange(daemon.control, bodies), 60))
        log = daemon.log()
    replies = [ReplyDecoder().decode(body) for body in raw]
    assert all(isinstance(r, ErrorReply) and r.code == "bad_message" for r in replies)
    # (Every reply is an ErrorReply, checked above: the filter only narrows the type.)
    assert [r.id for r in replies if isinstance(r, ErrorReply)] == [41, 42, "id-43", 44, 45]
    assert len(raw[0]) < 1024
    assert isinstance(replies[0], ErrorReply)
    assert replies[0].message.startswith("Object contains unknown field `KKKK")
    assert f"(truncated, {8 << 20} bytes)" in replies[0].message
    bad_lines = [line for line in log.splitlines() if '"bad message"' in line]
    assert len(bad_lines) == len(bodies)
    assert max(len(line) for line in bad_lines) < 2048
