"""What one control client leaves unread is bounded in bytes (issue 21, 3).

A real daemon with `--control-unread-bytes 200000` and the largest vocabulary allowed, so each
`welcome` is about 41 KB. A client asks `hello` again and again without reading: its ZeroMQ
pipe (256 messages) and the kernel's buffers fill, then the daemon queues welcomes in the
client's backlog and drops the client at the first one that takes the backlog past the
budget: exactly 5 of them (the daemon's log says how many, and their bytes). Once it reads,
the client gets every welcome that had left, then one `overloaded` error per hello it was not
answered (the queued welcomes included: a dropped client asks again rather than being kept
large replies), in order, and is served again; a bystander was served throughout.

Waits are bounded loops on the daemon's log and on received messages, never sleeps standing
in for an event.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.core.vocab import EXCLUDED_TOKEN_IDS_MAX
from engined.wire.control import DaemonMessage, ErrorReply, Pong, ReplyDecoder, Welcome
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import run

TIMEOUT_S = 20.0
BUDGET = 200_000
FLAGS = ("--speedup-ratio", "0", "--control-unread-bytes", str(BUDGET))
DECODER = ReplyDecoder()
HELLO = msgspec.msgpack.encode({"type": "hello"})
SENT = 1000
UNANSWERED = (
    "not processed: this client left more than 100000 messages unread, or more than 200000 "
    "bytes (control_unread_bytes), so it was dropped and its requests were cancelled; read, "
    "then send again"
)


def log_events(daemon: DaemonProcess, event: str) -> list[dict[str, Any]]:
    records = []
    for line in daemon.log().splitlines():
        if f'"{event}"' in line:
            records.append(json.loads(line))
    return records


async def read_all(sock: zmq.asyncio.Socket, count: int) -> list[DaemonMessage]:
    seen: list[DaemonMessage] = []
    async with asyncio.timeout(TIMEOUT_S):
        while len(seen) < count:
            seen.append(DECODER.decode(await sock.recv()))
    return seen


def test_a_client_that_leaves_large_replies_unread_is_dropped_at_its_byte_budget(
    tmp_path: Path,
) -> None:
    largest = list(range(2**32 - EXCLUDED_TOKEN_IDS_MAX, 2**32))
    with start_daemon(tmp_path, *FLAGS) as daemon:

        async def scenario() -> None:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(daemon.control)
            try:
                async with await EngineClient.connect(daemon.control, ctx=ctx) as bystander:
                    await bystander.set_vocabulary(2**32, largest, timeout=TIMEOUT_S)
                    await sock.send(HELLO)
                    welcome = await sock.recv()
                    assert isinstance(DECODER.decode(welcome), Welcome)
                    size = len(welcome)
                    queued = BUDGET // size + 1
                    assert queued == 5
                    # Far more than the pipe and the kernel hold (~270 of these), fewer than
                    # the 1,024 unanswered messages a dropped client is kept replies for.
                    for _ in range(SENT):
                        await sock.send(HELLO)
                    deadline = time.monotonic() + TIMEOUT_S
                    while not log_events(daemon, "client gone"):
                        assert time.monotonic() < deadline, "never dropped"
                        await bystander.ping(timeout=TIMEOUT_S)  # a poll interval
                    (gone,) = log_events(daemon, "client gone")
                    assert (gone["reason"], gone["cancelled"]) == ("too slow", 0)
                    assert (gone["unread_limit"], gone["unread_bytes_limit"]) == (100_000, BUDGET)
                    assert (gone["queued"], gone["queued_bytes"]) == (queued, queued * size)
                    generation = await bystander.generate([1, 2, 3], 4, timeout=TIMEOUT_S)
                    assert generation.finish_reason == "length"

                    seen = await read_all(sock, SENT)
                    welcomes = [m for m in seen if isinstance(m, Welcome)]
                    refused = seen[len(welcomes) :]
                    assert seen[: len(welcomes)] == welcomes  # every welcome first, in order
                    assert len(refused) >= queued
                    for reply in refused:
                        assert isinstance(reply, ErrorReply)
                        assert (reply.id, reply.code, reply.message) == (
                            None,
                            "overloaded",
                            UNANSWERED,
                        )
                    await sock.send(msgspec.msgpack.encode({"type": "ping", "id": 7}))
                    (pong,) = await read_all(sock, 1)
                    assert isinstance(pong, Pong) and pong.id == 7
                    (back,) = log_events(daemon, "client back")
                    assert (back["delivered"], back["unanswered"]) == (
                        len(refused),
                        len(refused) - queued,
                    )
                    await bystander.set_vocabulary(None, timeout=TIMEOUT_S)
            finally:
                sock.close()
                ctx.term()

        run(scenario())
