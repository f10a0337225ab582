"""A client behind on its stream waits in a byte-counted backlog, not in ZeroMQ (issue 21, 3).

In process, as the daemon runs it: the ROUTER's pipe to each client is small (16 messages
here, 256 in the daemon) and what does not fit waits in the client's backlog, counted, until
the pipe takes it; the client is dropped only past `unread_messages` (pipe and backlog) or
`unread_bytes` (backlog). Small kernel buffers and a client RCVHWM of 1, so a client that
does not read fills its pipe within a few dozen messages.

1. A client that stops reading at speedup 0 while its request streams 3,000 outputs is not
   dropped: its backlog holds what the pipe cannot, and once it reads it gets every token
   in order and one terminal, and nothing is kept for it afterwards.
2. Past `unread_messages` it is dropped at exactly the message that passes the bound: the
   log names the backlog it had; its requests leave the core; once it reads it learns each
   was cancelled, once.
3. A client that vanishes while its pipe has room is dropped at the next send to it
   ("unreachable"), though backlogs are allowed. (One that vanishes with its pipe full looks,
   to libzmq, like one that does not read: test 2.)
4. A backlog that sends nothing for BACKLOG_STALL_S, of a client with nothing in flight, is
   dropped: its replies become notices, delivered in order once the client reads.

Waits are bounded loops on the server's per-client state, the core's requests and received
messages, never sleeps standing in for an event.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import zmq.asyncio

from engined.config.schema import CONTROL_UNREAD_BYTES
from engined.server.control import clients
from engined.wire.control import (
    DaemonMessage,
    Output,
    OutputEntry,
    Pong,
    ReplyDecoder,
    Submitted,
)
from tests.server.inprocess import serve
from tests.support import run, until

PIPE = 16
WAIT_S = 30.0
DECODER = ReplyDecoder()


def encode(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


async def read_until_finished(
    sock: zmq.asyncio.Socket, request_ids: set[str]
) -> list[DaemonMessage]:
    """Every message until each of `request_ids` has had a finished entry."""
    seen: list[DaemonMessage] = []
    finished: set[str] = set()
    async with asyncio.timeout(WAIT_S):
        while finished != request_ids:
            msg = DECODER.decode(await sock.recv())
            seen.append(msg)
            if isinstance(msg, Output):
                finished |= {e.request_id for e in msg.outputs if e.finished}
    return seen


def entries(seen: list[DaemonMessage], request_id: str) -> list[OutputEntry]:
    return [
        e for m in seen if isinstance(m, Output) for e in m.outputs if e.request_id == request_id
    ]


def test_a_reader_briefly_behind_at_speedup_0_keeps_its_stream(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serve(
            tmp_path, sndhwm=PIPE, unread_messages=100_000, num_gpu_blocks=4096
        ) as served:
            state = served.control.client_state
            sock = served.dealer(rcvhwm=1)
            request = {"request_id": "long", "token_ids": [5] * 16, "max_tokens": 3000}
            await sock.send(encode(type="submit", request=request, id=1))
            assert isinstance(DECODER.decode(await sock.recv()), Submitted)
            # Not reading: the pipe fills and the rest waits in the backlog.
            await until(lambda: state()["backlogs"] == 1, "a backlog", timeout=WAIT_S)
            assert 0 < state()["queued_bytes"] <= CONTROL_UNREAD_BYTES
            seen = await read_until_finished(sock, {"long"})
            mine = entries(seen, "long")
            assert sum(len(e.token_ids) for e in mine) == 3000
            assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
            assert mine[-1].finish_reason == "length"
            assert state()["dropped"] == 0
            await until(lambda: state()["tracked"] == 0, "its state freed", timeout=WAIT_S)
            assert state() == dict.fromkeys(state(), 0)

    run(scenario(), 60)


def test_past_its_unread_messages_a_client_is_dropped_and_told(tmp_path: Path) -> None:
    limit = 64
    requests = {"slow-0", "slow-1"}

    async def scenario() -> list[Any]:
        with structlog.testing.capture_logs() as logs:
            async with serve(
                tmp_path, sndhwm=PIPE, unread_messages=limit, speedup_ratio=5.0
            ) as served:
                state = served.control.client_state
                sock = served.dealer(rcvhwm=1)
                for n, request_id in enumerate(sorted(requests)):
                    request = {
                        "request_id": request_id,
                        "token_ids": [n + 1] * 16,
                        "max_tokens": 10**5,
                    }
                    await sock.send(encode(type="submit", request=request, id=n))
                await until(lambda: state()["dropped"] == 1, "dropped", timeout=WAIT_S)
                assert (state()["backlogs"], state()["queued_bytes"]) == (0, 0)
                await until(lambda: served.loop.engine.is_empty(), "cancelled", timeout=WAIT_S)
                seen = await read_until_finished(sock, requests)
                for request_id in requests:
                    mine = entries(seen, request_id)
                    assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
                    assert (mine[-1].token_ids, mine[-1].finish_reason) == ([], "cancelled")
                await until(lambda: state()["tracked"] == 0, "state freed", timeout=WAIT_S)
        return logs

    logs = run(scenario(), 60)
    (gone,) = [entry for entry in logs if entry["event"] == "client gone"]
    assert (gone["reason"], gone["cancelled"], gone["unread_limit"]) == ("too slow", 2, limit)
    # The pipe (16) and the backlog pass 64 with the 49th queued message.
    assert gone["queued"] == limit - PIPE + 1


def test_a_client_that_vanishes_is_dropped_at_the_next_send(tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        with structlog.testing.capture_logs() as logs:
            # Paced at 1 ms a pass, so its pipe is far from full when it goes.
            async with serve(
                tmp_path, sndhwm=PIPE, unread_messages=100_000, speedup_ratio=1.0
            ) as served:
                sock = served.dealer()
                request = {"request_id": "gone", "token_ids": [3] * 16, "max_tokens": 1_000_000}
                await sock.send(encode(type="submit", request=request, id=1))
                await sock.recv()
                sock.close()
                await until(lambda: served.loop.engine.is_empty(), "cancelled", timeout=WAIT_S)
                assert served.control.client_state()["backlogs"] == 0
        return logs

    logs = run(scenario(), 60)
    (gone,) = [entry for entry in logs if entry["event"] == "client gone"]
    assert (gone["reason"], gone["cancelled"]) == ("unreachable", 1)


def test_a_stalled_backlog_of_a_client_owning_nothing_becomes_notices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "BACKLOG_STALL_S", 0.2)
    pings = 3000  # far more than the pipe and small kernel buffers hold

    async def scenario() -> list[Any]:
        with structlog.testing.capture_logs() as logs:
            async with serve(tmp_path, sndhwm=PIPE, unread_messages=100_000) as served:
                state = served.control.client_state
                sock = served.dealer(rcvhwm=1)
                for n in range(pings):
                    await sock.send(encode(type="ping", id=n))
                await until(lambda: state()["dropped"] == 1, "dropped", timeout=WAIT_S)
                assert (state()["backlogs"], state()["queued_bytes"]) == (0, 0)
                kept = state()["notices"]
                seen: list[DaemonMessage] = []
                async with asyncio.timeout(WAIT_S):
                    while len(seen) < pings:
                        seen.append(DECODER.decode(await sock.recv()))
                assert [(type(m), getattr(m, "id", None)) for m in seen] == [
                    (Pong, n) for n in range(pings)
                ]
                await until(lambda: state()["tracked"] == 0, "state freed", timeout=WAIT_S)
        return [kept, *logs]

    kept, *logs = run(scenario(), 60)
    (gone,) = [entry for entry in logs if entry["event"] == "client gone"]
    assert (gone["reason"], gone["cancelled"], gone["queued"]) == ("too slow", 0, kept)
    assert kept > 0
