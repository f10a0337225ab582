"""The control ROUTER's largest message is derived from the configuration (issue 21, 1).

A real daemon with a 1,024-token pool: its largest useful message is a `set_vocabulary` with
every excluded id allowed (41,984 bytes with its ids and keys), so its MAXMSGSIZE is that plus
the 1 MiB margin, and the start-up log says so. A message of exactly that size is read and
answered; one byte more and libzmq drops the sender's connection unanswered, while the daemon
and its other clients go on and the sender, once reconnected, is served again.

Waits are bounded loops on received messages, never sleeps standing in for an event.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.server.control.budgets import MESSAGE_MARGIN_BYTES
from engined.wire.control import DaemonMessage, DirectReply, ErrorReply, Pong, ReplyDecoder
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import run

TIMEOUT_S = 10.0
FLAGS = ("--speedup-ratio", "0", "--block-size", "16", "--num-gpu-blocks", "64")
# 8,192 excluded ids at 5 bytes each and 1 KiB of ids and keys, over 2 x 1,024 tokens' 10 KiB.
LIMIT = 8192 * 5 + 1024 + MESSAGE_MARGIN_BYTES
DECODER = ReplyDecoder()


def started(daemon: DaemonProcess) -> dict[str, Any]:
    for line in daemon.log().splitlines():
        if '"engined started"' in line:
            record: dict[str, Any] = json.loads(line)
            return record
    raise AssertionError(f"no start-up line:\n{daemon.log()}")


def submit_of_size(size: int, message_id: int) -> tuple[bytes, int]:
    """A `submit` body of exactly `size` bytes (one-byte token ids, an array32 header), and
    its number of tokens."""
    probe = 1 << 16

    def body(tokens: int) -> bytes:
        request = {"token_ids": [1] * tokens, "max_tokens": 1}
        return msgspec.msgpack.encode({"type": "submit", "request": request, "id": message_id})

    tokens = size - (len(body(probe)) - probe)
    encoded = body(tokens)
    assert len(encoded) == size and tokens >= probe
    return encoded, tokens


async def replies_until_pong(sock: zmq.asyncio.Socket) -> list[DaemonMessage]:
    """Ping (ids 100, 101, ...) until a pong comes back; every message received on the way.

    The first pings may be lost with a dropped connection, so each is followed by a bounded
    wait for a reply before the next is sent.
    """
    seen: list[DaemonMessage] = []
    async with asyncio.timeout(60):
        for ping_id in itertools.count(100):
            await sock.send(msgspec.msgpack.encode({"type": "ping", "id": ping_id}))
            while await sock.poll(500):
                seen.append(DECODER.decode(await sock.recv()))
                if any(isinstance(m, Pong) for m in seen):
                    return seen
    raise AssertionError("unreachable")


def test_the_largest_message_is_derived_and_one_byte_more_is_cut(tmp_path: Path) -> None:
    with start_daemon(tmp_path, *FLAGS) as daemon:
        assert started(daemon)["limits"]["control_max_message_bytes"] == LIMIT == 1_090_560

        async def scenario() -> None:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(daemon.control)
            try:
                async with await EngineClient.connect(daemon.control, ctx=ctx) as bystander:
                    largest, tokens = submit_of_size(LIMIT, 1)
                    await sock.send(largest)
                    async with asyncio.timeout(TIMEOUT_S):
                        reply = DECODER.decode(await sock.recv())
                    assert isinstance(reply, ErrorReply) and reply.id == 1
                    assert (reply.code, reply.message) == (
                        "invalid_request",
                        f"request.token_ids: {tokens} tokens exceed the KV pool capacity "
                        "of 1008 tokens",  # 63 of the 64 blocks: vLLM's null block is the 64th
                    )
                    await sock.send(submit_of_size(LIMIT + 1, 2)[0])
                    await bystander.ping(timeout=TIMEOUT_S)
                    seen = await replies_until_pong(sock)
                    assert not [m for m in seen if isinstance(m, DirectReply) and m.id == 2]
                    assert all(isinstance(m, Pong) for m in seen), seen
                    generation = await bystander.generate([1, 2, 3], 4, timeout=TIMEOUT_S)
                    assert generation.finish_reason == "length"
            finally:
                sock.close()
                ctx.term()

        run(scenario())
