"""A client that stops reading is dropped, and learns what happened when it reads again
(issue 10, defect 6).

In process, with the ROUTER's SNDHWM at 1,024 instead of the daemon's 100,000, small kernel
buffers and a client RCVHWM of 16, so a client that does not read overflows its pipe within
about 1,300 passes. NOTE: libzmq gives a full pipe room again once its I/O thread has moved
half the high-water mark on; everything downstream of the ROUTER (kernel buffers, batches, the
client's 16) holds far fewer messages than that, so once this client is dropped it stays
dropped until it reads. The requests' passes are paced (speedup 5: 0.2 ms each) so the I/O
thread is not left a burst to catch up with, which could otherwise fill the pipe first.

1. It submitted three long requests and stopped reading: it is dropped once (one "client
   gone" warning), the three requests leave the core, and a ping it sends meanwhile is not
   processed. Once it reads, without sending anything, it receives an `overloaded` error
   for that ping (with its id) and one `cancelled` terminal per request, with nothing after
   it; its next ping is answered `pong`; the episode ends with one "client back" line and
   every piece of per-client state is freed.
2. The same when the only trigger is the client's own messages (the periodic retry
   disabled): every message it sent got exactly one reply, `overloaded` or `pong`.
3. With room for two `overloaded` replies, five messages sent while dropped: the first two
   are answered with their ids, the other three counted in one error without an id.
4. A `watch_load` client that stops reading is dropped and, once it reads, is subscribed
   again: it gets every rank's current load after its backlog.

Waits are bounded loops on observable state (the server's per-client state, the core's
requests, received messages), never sleeps standing in for an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.server.control import clients, episodes
from engined.wire.control import (
    DaemonMessage,
    DirectReply,
    ErrorReply,
    Load,
    Output,
    OutputEntry,
    Pong,
    ReplyDecoder,
)
from engined.wire.convert import load_message
from tests.server.inprocess import Served, serve
from tests.support import until

SNDHWM = 1024
CLIENT_RCVHWM = 16
SPEEDUP = 5.0
WAIT_S = 20.0
REQUESTS = ["slow-0", "slow-1", "slow-2"]
DECODER = ReplyDecoder()


def encode(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


async def read_until(
    sock: zmq.asyncio.Socket, seen: list[DaemonMessage], done: Callable[[], bool]
) -> None:
    async with asyncio.timeout(WAIT_S):
        while not done():
            seen.append(DECODER.decode(await sock.recv()))


def entries(seen: list[DaemonMessage]) -> list[OutputEntry]:
    return [e for m in seen if isinstance(m, Output) for e in m.outputs]


def terminals(seen: list[DaemonMessage]) -> dict[str, list[OutputEntry]]:
    out: dict[str, list[OutputEntry]] = {}
    for entry in entries(seen):
        if entry.finished:
            out.setdefault(entry.request_id, []).append(entry)
    return out


def replies(seen: list[DaemonMessage], message_id: int) -> list[DirectReply]:
    return [m for m in seen if isinstance(m, DirectReply) and m.id == message_id]


def assert_each_cancelled_once(seen: list[DaemonMessage]) -> None:
    ends = terminals(seen)
    assert sorted(ends) == REQUESTS, ends
    for request_id, finals in ends.items():
        assert [(f.token_ids, f.finish_reason) for f in finals] == [([], "cancelled")]
        mine = [e for e in entries(seen) if e.request_id == request_id]
        assert mine[-1] is finals[0], f"{request_id}: an entry followed its terminal"


async def submit_and_stop_reading(
    served: Served, sock: zmq.asyncio.Socket, *, retried: bool = True
) -> None:
    for n, request_id in enumerate(REQUESTS):
        request = {"request_id": request_id, "token_ids": [n + 1] * 16, "max_tokens": 5000}
        await sock.send(encode(type="submit", request=request, id=n + 1))
    state = served.control.client_state
    await until(lambda: state()["dropped"] == 1, "the client dropped")
    await until(lambda: served.loop.engine.is_empty(), "its requests cancelled")
    # The first EAGAIN may be libzmq's I/O thread lagging rather than a full pipe (it then
    # drains and the pipe has room again); two failed retries mean the client is not reading.
    if retried:
        await until(lambda: state()["stalls"] >= 2, "the pipe stayed full")


def log_events(logs: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


def test_a_reader_that_comes_back_learns_what_happened(tmp_path: Path) -> None:
    async def scenario() -> list[MutableMapping[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            async with serve(tmp_path, sndhwm=SNDHWM, speedup_ratio=SPEEDUP) as served:
                sock = served.dealer(rcvhwm=CLIENT_RCVHWM)
                await submit_and_stop_reading(served, sock)
                notices = served.control.client_state()["notices"]
                await sock.send(encode(type="ping", id=100))
                await until(
                    lambda: served.control.client_state()["notices"] == notices + 1,
                    "the ping kept unanswered",
                )
                seen: list[DaemonMessage] = []
                # Reading alone is enough: the daemon retries a slow client by itself.
                await read_until(sock, seen, lambda: len(terminals(seen)) == len(REQUESTS))
                await read_until(sock, seen, lambda: bool(replies(seen, 100)))
                (refusal,) = replies(seen, 100)
                assert isinstance(refusal, ErrorReply)
                assert refusal.code == "overloaded"
                assert f"more than {SNDHWM} messages unread" in refusal.message
                for n in range(len(REQUESTS)):
                    assert [type(r).__name__ for r in replies(seen, n + 1)] == ["Submitted"]
                assert_each_cancelled_once(seen)
                await sock.send(encode(type="ping", id=101))
                await read_until(sock, seen, lambda: bool(replies(seen, 101)))
                assert isinstance(replies(seen, 101)[0], Pong)
                assert_each_cancelled_once(seen)
                state = served.control.client_state
                await until(lambda: state()["tracked"] == 0, "the client's state freed")
                assert state() == dict.fromkeys(state(), 0)
        return logs

    logs = asyncio.run(asyncio.wait_for(scenario(), 60))
    (gone,) = log_events(logs, "client gone")
    assert (gone["reason"], gone["cancelled"], gone["unread_limit"]) == ("too slow", 3, SNDHWM)
    assert gone["log_level"] == "warning"
    (back,) = log_events(logs, "client back")
    assert (back["unanswered"], back["ignored"], back["lost"]) == (1, 0, 0)


def test_every_message_of_a_dropped_client_gets_one_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "DROPPED_RETRY_S", 3600.0)

    async def scenario() -> None:
        async with serve(tmp_path, sndhwm=SNDHWM, speedup_ratio=SPEEDUP) as served:
            sock = served.dealer(rcvhwm=CLIENT_RCVHWM)
            await submit_and_stop_reading(served, sock, retried=False)
            seen: list[DaemonMessage] = []
            pings: list[int] = []
            for round_ in range(500):
                while await sock.poll(20):
                    seen.append(DECODER.decode(await sock.recv()))
                if pings and any(isinstance(r, Pong) for r in replies(seen, pings[-1])):
                    break
                pings.append(1000 + round_)
                await sock.send(encode(type="ping", id=pings[-1]))
            else:
                raise AssertionError("never answered")
            for ping in pings:
                (reply,) = replies(seen, ping)
                assert isinstance(reply, Pong | ErrorReply)
                if isinstance(reply, ErrorReply):
                    assert reply.code == "overloaded"
            assert_each_cancelled_once(seen)
            assert served.control.client_state()["dropped"] == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_messages_past_the_cap_are_counted_in_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(episodes, "MAX_UNANSWERED", 2)

    async def scenario() -> None:
        async with serve(tmp_path, sndhwm=SNDHWM, speedup_ratio=SPEEDUP) as served:
            sock = served.dealer(rcvhwm=CLIENT_RCVHWM)
            await submit_and_stop_reading(served, sock)
            state = served.control.client_state
            notices = state()["notices"]
            for ping in range(5):
                await sock.send(encode(type="ping", id=200 + ping))
            # Two kept as replies; the other three only counted.
            await until(lambda: state()["notices"] == notices + 2, "two replies kept")
            seen: list[DaemonMessage] = []
            await read_until(
                sock,
                seen,
                lambda: any(isinstance(m, ErrorReply) and m.id is None for m in seen),
            )
            assert [type(r[0]).__name__ for r in (replies(seen, 200), replies(seen, 201))] == [
                "ErrorReply",
                "ErrorReply",
            ]
            assert not any(replies(seen, 200 + n) for n in (2, 3, 4))
            summary = [m for m in seen if isinstance(m, ErrorReply) and m.id is None]
            assert len(summary) == 1
            assert summary[0].code == "overloaded"
            assert summary[0].message.startswith("3 more messages were not processed")
            assert_each_cancelled_once(seen)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_load_watcher_is_subscribed_again_when_it_reads(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serve(tmp_path, sndhwm=SNDHWM) as served:
            watcher = served.dealer(rcvhwm=SNDHWM)
            worker = await EngineClient.connect(served.endpoint, ctx=served.ctx)
            await watcher.send(encode(type="watch_load", id=1))
            state = served.control.client_state
            await until(lambda: state()["watching"] == 1, "the watch registered")
            # Every request changes the load (queued, running, done): a stream of `load`.
            for n in range(5000):
                await worker.generate([n % 50 + 1] * 32, 1)
                if state()["dropped"]:
                    break
            await worker.close()
            await until(lambda: state()["dropped"] == 1, "the watcher dropped")
            assert state()["watching"] == 0
            await until(lambda: served.loop.engine.is_empty(), "the worker's requests done")
            seen: list[DaemonMessage] = []
            await watcher.send(encode(type="ping", id=2))
            await read_until(watcher, seen, lambda: bool(replies(seen, 2)))
            await until(lambda: state()["watching"] == 1, "the watcher subscribed again")
            await watcher.send(encode(type="ping", id=3))
            await read_until(watcher, seen, lambda: bool(replies(seen, 3)))
            # Whatever it missed, the last load it has is the rank's load now.
            last = [m for m in seen if isinstance(m, Load)][-1]
            assert last == load_message(served.loop.engine.metrics())
            assert state()["dropped"] == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
