"""SIGTERM during a flood of submits: every message the daemon read is answered (issue 21, 3).

A black-box run found 1,000 of 5,000 submits with no reply at all: at shutdown the daemon
closed its control socket with messages still queued there (ZeroMQ discards them), and,
after the drain timeout, a submit still queued at its rank got its `cancelled` terminal
before its `submitted`. Now intake closes before the ranks stop (the terminals follow the
ranks' replies), and what is queued at the socket is read and answered before it closes.

1. A real daemon (one rank, then two ranks in worker processes) and a raw DEALER sending
   5,000 submits as fast as it can; the test sends SIGTERM once 100 replies are in, and reads
   until the daemon's connection is gone (a socket monitor reports the disconnect after the
   last byte). The daemon reads one client's messages in order, so the answered ids must be
   a prefix of those sent, each answered once, `submitted` or `shutting_down`, and every
   `submitted` followed by exactly one terminal.
2. In process, on inproc:// (a send lands in the ROUTER's queue before it returns, and a
   reply in the client's, so "nothing yet" is a fact, not a wait): a submit queued at a rank
   that has not run yet gets `submitted` before its terminal; messages queued once the
   ranks have stopped (pings, submits, garbage, a 1 MiB key) are all answered, up to the
   read bound; a client still sending one message after another is read until the bound;
   a message sent after the socket was drained gets nothing.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engined.server.control import control_reader as control_module
from engined.server.control.control_server import ControlServer
from engined.server.control.settings import RuntimeSettings
from engined.server.ranks.engine_loop import EngineLoop
from engined.wire.control import (
    DaemonMessage,
    ErrorReply,
    Output,
    Pong,
    ReplyDecoder,
    Submitted,
)
from engined.zmq_sockets import make_socket
from tests.server.daemon_harness import start_daemon
from tests.server.inprocess import engine_loop, welcome
from tests.support import run, until

FLOOD = 5000
SIGNAL_AFTER = 100
WAIT_S = 30.0
DECODER = ReplyDecoder()


def submit(message_id: int | str, max_tokens: int = 100_000) -> bytes:
    request = {"token_ids": [message_id if isinstance(message_id, int) else 7] * 16}
    return msgspec.msgpack.encode(
        {"type": "submit", "id": message_id, "request": {**request, "max_tokens": max_tokens}}
    )


def ping(message_id: int | str) -> bytes:
    return msgspec.msgpack.encode({"type": "ping", "id": message_id})


# --- 1. a real daemon --------------------------------------------------------------------------


def flood_through_sigterm(endpoint: str, stop: object, count: int = FLOOD) -> list[DaemonMessage]:
    """Send `count` submits without waiting, reading as they come; call `stop()` once
    SIGNAL_AFTER replies are in; then read until the daemon's side of the connection is
    gone. Everything received, in order (benchmarks/abuse_shutdown.py plays it too)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(option, value)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    received: list[DaemonMessage] = []

    def take_queued() -> None:
        while True:
            try:
                received.append(DECODER.decode(sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return

    def replies() -> int:
        return sum(not isinstance(message, Output) for message in received)

    try:
        stopped = False
        for n in range(count):
            sock.send(submit(n))
            take_queued()
            if not stopped and replies() >= SIGNAL_AFTER:
                stop()  # type: ignore[operator]
                stopped = True
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        while not stopped:
            received.append(DECODER.decode(sock.recv()))
            if replies() >= SIGNAL_AFTER:
                stop()  # type: ignore[operator]
                stopped = True
        # The disconnect is reported once the I/O thread has read the last byte.
        assert monitor.poll(int(WAIT_S * 1000)), "the daemon never closed the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        take_queued()
        return received
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "layout",
    [["--rank-processes", "0"], ["--data-parallel-size", "2", "--rank-processes", "2"]],
    ids=["one-rank", "two-rank-workers"],
)
def test_sigterm_during_a_flood_answers_every_submit_read(
    tmp_path: Path, layout: list[str]
) -> None:
    """--drain-timeout 0: SIGTERM ends every running request at once, while the flood's
    submits are still being read and applied, which is where the order broke."""
    args = ["--speedup-ratio", "0", "--drain-timeout", "0", "--max-queued-requests", "0"]
    with start_daemon(tmp_path, *args, *layout) as daemon:
        received = flood_through_sigterm(
            daemon.control, lambda: daemon.proc.send_signal(signal.SIGTERM)
        )
        assert daemon.proc.wait(WAIT_S) == 0, daemon.log()

    answers: dict[int, str] = {}
    submitted_at: dict[str, int] = {}
    terminals: dict[str, list[tuple[int, str | None]]] = {}
    for position, message in enumerate(received):
        if isinstance(message, Output):
            for entry in message.outputs:
                if entry.finished:
                    terminals.setdefault(entry.request_id, []).append(
                        (position, entry.finish_reason)
                    )
            continue
        assert isinstance(message, Submitted | ErrorReply), message
        assert isinstance(message.id, int) and message.id not in answers, message
        if isinstance(message, Submitted):
            answers[message.id] = "submitted"
            submitted_at[message.request_id] = position
        else:
            answers[message.id] = message.code
    # Read in order, each read answered: the answered ids are a prefix of those sent.
    assert sorted(answers) == list(range(len(answers))), "a message read was not answered"
    assert set(answers.values()) <= {"submitted", "shutting_down"}, answers
    assert all(answers[n] == "submitted" for n in range(SIGNAL_AFTER))
    for request_id, at in submitted_at.items():
        ends = terminals.pop(request_id, [])
        assert len(ends) == 1, (request_id, ends)
        assert ends[0][0] > at, f"{request_id}: terminal before its submitted"
    assert terminals == {}, "terminals of requests never submitted"
    assert '"control socket drained"' in daemon.log()


# --- 2. in process, on inproc:// -----------------------------------------------------------------


class Inproc:
    """A ControlServer and one rank on an inproc ROUTER, and a raw client; the rank's loop
    is started by the test (`start_rank`), so commands can wait in its inbox."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        endpoint = "inproc://control"
        router = make_socket(
            self.ctx, zmq.ROUTER, endpoint, bind=True, sndhwm=0, rcvhwm=0, router_mandatory=True
        )
        self.router = router
        self.control = ControlServer(
            router,
            welcome=welcome,
            settings=RuntimeSettings(
                vocab_size=None, excluded_token_ids=(), fpm_worker_id="w", fpm=[]
            ),
            max_queued_requests=0,
        )
        self.loop: EngineLoop = engine_loop(self.control)
        self.control.attach([self.loop])
        self.reader = asyncio.create_task(self.control.serve())
        self.rank: asyncio.Task[None] | None = None
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.setsockopt(zmq.RCVHWM, 0)
        self.client.connect(endpoint)
        # Synchronous sends and reads of the same socket: inproc delivers before they return.
        self.sync: zmq.Socket[bytes] = zmq.Socket.shadow(self.client.underlying)

    def start_rank(self) -> None:
        self.rank = asyncio.create_task(self.loop.run())

    async def stop_rank(self) -> None:
        self.loop.stop()
        assert self.rank is not None
        await asyncio.wait_for(self.rank, WAIT_S)

    def queued(self) -> list[DaemonMessage]:
        """Every reply already delivered to the client."""
        out = []
        while True:
            try:
                out.append(DECODER.decode(self.sync.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    async def reply(self) -> DaemonMessage:
        return DECODER.decode(await asyncio.wait_for(self.client.recv(), WAIT_S))

    async def close(self) -> None:
        for task in (self.reader, self.rank):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (self.reader, self.rank) if t is not None), return_exceptions=True
        )
        self.client.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


async def settled() -> None:
    """Let every task that can run do so (a few turns of the event loop, no timer)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_submit_queued_at_its_rank_is_answered_before_its_terminal() -> None:
    async def scenario() -> None:
        served = Inproc()
        try:
            served.sync.send(submit("queued"))
            # The reader claims it and queues it at the rank, which is not running yet.
            await until(lambda: served.control.owned_requests() == 1, "the submit claimed")
            served.control.shutting_down = True
            closing = asyncio.create_task(served.control.close_intake())
            await settled()
            assert not closing.done()
            assert served.queued() == [], "the terminal went out before the submit's reply"
            served.start_rank()
            await asyncio.wait_for(closing, WAIT_S)
            first, second = served.queued()
            assert isinstance(first, Submitted) and first.id == "queued"
            assert isinstance(second, Output)
            ((entry),) = second.outputs
            assert (entry.request_id, entry.finished, entry.finish_reason) == (
                first.request_id,
                True,
                "cancelled",
            )
            assert served.control.owned_requests() == 0
            await served.stop_rank()
        finally:
            await served.close()

    run(scenario())


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(control_module, "CLOSE_READ_MESSAGES", 50)
    yield 50


def test_a_client_still_sending_is_read_until_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow input: messages that come one by one, each after the previous reply, are read
    while they keep coming (the quiet window is made long, so only the bound ends it)."""
    monkeypatch.setattr(control_module, "CLOSE_QUIET_S", 3600.0)
    monkeypatch.setattr(control_module, "CLOSE_READ_S", 3600.0)
    monkeypatch.setattr(control_module, "CLOSE_READ_MESSAGES", 3)

    async def scenario() -> None:
        served = Inproc()
        served.start_rank()
        try:
            served.control.shutting_down = True
            await served.control.close_intake()
            await served.stop_rank()
            served.sync.send(ping(0))
            draining = asyncio.create_task(served.control.answer_queued())
            for n in range(3):
                pong = await served.reply()
                assert isinstance(pong, Pong) and pong.id == n
                if n < 2:
                    assert not draining.done()
                    served.sync.send(ping(n + 1))
            await asyncio.wait_for(draining, WAIT_S)
            served.sync.send(ping("late"))
            await settled()
            assert served.queued() == []
        finally:
            await served.close()

    run(scenario())


def test_messages_queued_when_the_ranks_stop_are_answered(small_bound: int) -> None:
    """Queued once the ranks have stopped: submits, a cancel and a stats (rank commands)
    get `shutting_down`, a ping its pong, garbage its `bad_message`; beyond the read bound
    and after the drain, nothing is read."""

    async def scenario() -> None:
        served = Inproc()
        served.start_rank()
        try:
            served.sync.send(ping("up"))
            assert isinstance(await served.reply(), Pong)
            served.control.shutting_down = True
            await served.control.close_intake()
            await served.stop_rank()
            bodies = [submit(n, 4) for n in range(30)]
            bodies += [
                msgspec.msgpack.encode({"type": "cancel", "id": "c", "request_id": "x"}),
                msgspec.msgpack.encode({"type": "stats", "id": "s"}),
                ping("p"),
                b"\xc1 not msgpack",
                msgspec.msgpack.encode({"type": "ping", "id": "huge", "k" * (1 << 20): 1}),
            ]
            bodies += [ping(f"over-{n}") for n in range(small_bound - len(bodies) + 5)]
            for body in bodies:
                served.sync.send(body)
            await served.control.answer_queued()
            replies = served.queued()
            assert len(replies) == small_bound
            by_id = {getattr(reply, "id", None): reply for reply in replies}
            for n in range(30):
                reply = by_id[n]
                assert isinstance(reply, ErrorReply) and reply.code == "shutting_down", reply
                assert reply.message == "the daemon is shutting down"
            for message_id in ("c", "s"):
                reply = by_id[message_id]
                assert isinstance(reply, ErrorReply) and reply.code == "shutting_down"
            assert isinstance(by_id["p"], Pong)
            garbage = by_id[None]
            assert isinstance(garbage, ErrorReply) and garbage.code == "bad_message"
            huge = by_id["huge"]
            assert isinstance(huge, ErrorReply) and huge.code == "bad_message"
            assert "(truncated, 1048576 bytes)" in huge.message
            over = [k for k in by_id if isinstance(k, str) and k.startswith("over")]
            assert over == [f"over-{n}" for n in range(small_bound - 35)]
            # The socket is no longer read: a late message stays unanswered.
            served.sync.send(ping("late"))
            await settled()
            assert served.queued() == []
            assert served.reader.done()
        finally:
            await served.close()

    run(scenario())


def test_a_reader_waiting_for_a_message_is_stopped_without_losing_one() -> None:
    """The reader waits in recv when intake closes; the drain cancels that wait (which
    holds no message) and reads what came since itself."""

    async def scenario() -> None:
        served = Inproc()
        served.start_rank()
        try:
            served.sync.send(ping(1))
            assert isinstance(await served.reply(), Pong)
            await settled()  # the reader is back in recv, waiting
            served.control.shutting_down = True
            await served.control.close_intake()
            await served.stop_rank()
            served.sync.send(ping(2))
            await served.control.answer_queued()
            (pong,) = served.queued()
            assert isinstance(pong, Pong) and pong.id == 2
        finally:
            await served.close()

    run(scenario())
