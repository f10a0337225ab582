"""No client, and no late rank, keeps the event loop from the rest of the daemon (issue 10, 1-2).

Everything of a daemon shares one event loop: the ranks' passes, the control reader, the
publishers, HTTP, signals and the systemd watchdog. These tests show that each gets its turn:

1. A burst of 100,000 pings from one client while another streams: the control reader
   handles at most CONTROL_TURN_MESSAGES of them between two passes, the stream finishes long
   before the burst is drained, and the watchdog task keeps running.
2. A paced rank whose passes run late still yields once per pass.
3. A real daemon at speedup 1 whose every pass is late answers a ping while requests are in
   flight, and SIGTERM with `--drain-timeout 1` cancels them instead of waiting for the work.
4. With a paced rank already due, the control reader yields after every message.

Order and counts are asserted, not wall-clock intervals: which of two things happened first,
how many messages were handled between two passes.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.core.pass_report import PassReport
from engined.core.types import Decodes, LifecycleEvent, Request, RequestOutput, Submit
from engined.server.control.control_reader import CONTROL_TURN_MESSAGES
from engined.server.control.control_server import ControlServer
from engined.server.control.control_socket import CONTROL_HWM
from engined.server.ops.systemd import NullNotifier, keepalive
from engined.server.ranks.deadlines import Deadlines
from engined.wire import control as wire
from tests.server.daemon_harness import DaemonProcess
from tests.server.inprocess import Served, engine_loop, serve
from tests.server.virtual_clock import VirtualClock

BURST = 100_000
STREAM_TOKENS = 300
NUM_GPU_BLOCKS = 256


class CountingNotifier(NullNotifier):
    """systemd's side of the watchdog, as a counter."""

    def __init__(self) -> None:
        self.watchdogs = 0

    def watchdog(self) -> bool:
        self.watchdogs += 1
        return True


def flood(endpoint: str, count: int) -> None:
    """One client's burst of pings, sent as fast as libzmq takes them (a thread)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, count)
    sock.connect(endpoint)
    ping = msgspec.msgpack.encode({"type": "ping"})
    try:
        for _ in range(count):
            sock.send(ping)
        # Read the pongs, so the daemon's replies never back up.
        for _ in range(count):
            sock.recv()
    finally:
        sock.close()
        ctx.term()


def burst_server(tmp_path: Path, **kwargs: Any) -> AbstractAsyncContextManager[Served]:
    """An in-process server whose ROUTER takes a whole burst (the daemon's high-water marks
    and the system's kernel buffers)."""
    return serve(
        tmp_path,
        sndhwm=CONTROL_HWM,
        rcvhwm=CONTROL_HWM,
        sndbuf=None,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        **kwargs,
    )


class DispatchCounter:
    """Counts the control messages a server dispatched (wraps what its reader calls)."""

    def __init__(self, control: ControlServer) -> None:
        self.handled = 0
        reader = control._reader
        dispatch = reader._dispatch

        def counting_dispatch(identity: bytes, msg: wire.ClientMessage, frame: zmq.Frame) -> None:
            self.handled += 1
            dispatch(identity, msg, frame)

        reader._dispatch = counting_dispatch


def test_a_ping_burst_yields_to_passes_and_to_other_clients(tmp_path: Path) -> None:
    async def scenario() -> None:
        # (messages dispatched when the pass ran, stream entries received by then)
        passes: list[int] = []
        stream_done_at: int | None = None
        async with burst_server(tmp_path) as served:
            endpoint = served.endpoint
            counter = DispatchCounter(served.control)
            served.loop.pass_observers.append(
                lambda rank, now_ms, result: passes.append(counter.handled)
            )
            notifier = CountingNotifier()
            watchdog = asyncio.create_task(keepalive(notifier, str, watchdog_s=0.001))
            client = await EngineClient.connect(endpoint, ctx=served.ctx)
            try:
                await client.ping()
                flooder = threading.Thread(target=flood, args=(endpoint, BURST))
                flooder.start()
                # The burst is under way once the first of its pings was handled.
                while counter.handled < 2:
                    await asyncio.sleep(0)
                watchdogs_before = notifier.watchdogs
                await client.submit(list(range(64)), STREAM_TOKENS, request_id="stream")
                async for entry in client.outputs("stream"):
                    if entry.finished:
                        stream_done_at = counter.handled
                assert stream_done_at is not None
                # The stream ran to its end while the burst was still being read ...
                assert stream_done_at < BURST / 2, stream_done_at
                # ... the watchdog task kept its turns ...
                assert notifier.watchdogs > watchdogs_before
                await asyncio.to_thread(flooder.join, 60)
                assert not flooder.is_alive()
                # ... and no pass waited for more than one bounded turn of the reader. (The
                # ping and submit of the streaming client are two more messages per turn at
                # most.)
                gaps = [later - earlier for earlier, later in itertools.pairwise(passes)]
                assert len(passes) >= STREAM_TOKENS
                assert max(gaps) <= CONTROL_TURN_MESSAGES, max(gaps)
            finally:
                await client.close()
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_due_rank_cuts_the_control_readers_turn_to_one_message(tmp_path: Path) -> None:
    """With a paced rank of the loop already due (engined.server.ranks.deadlines), the reader
    yields after every message: between two passes of the streaming rank it handles a
    message or two, where the same burst without a due rank fills whole turns."""

    async def burst_gaps(due: bool) -> int:
        passes: list[int] = []
        deadlines = Deadlines()
        if due:
            deadlines.set(99, float("-inf"))  # a paced rank that waits for the loop
        async with burst_server(tmp_path, deadlines=deadlines) as served:
            counter = DispatchCounter(served.control)
            served.loop.pass_observers.append(
                lambda rank, now_ms, result: passes.append(counter.handled)
            )
            client = await EngineClient.connect(served.endpoint, ctx=served.ctx)
            try:
                await client.ping()
                flooder = threading.Thread(target=flood, args=(served.endpoint, 5_000))
                flooder.start()
                while counter.handled < 2:
                    await asyncio.sleep(0)
                first = len(passes)
                await client.submit(list(range(64)), STREAM_TOKENS, request_id="stream")
                async for entry in client.outputs("stream"):
                    if entry.finished or counter.handled >= 5_000:
                        break
                await asyncio.to_thread(flooder.join, 60)
            finally:
                await client.close()
        during = passes[first:]
        assert len(during) >= 10, len(during)
        return max(later - earlier for earlier, later in itertools.pairwise(during))

    assert asyncio.run(asyncio.wait_for(burst_gaps(due=True), 120)) <= 3
    assert asyncio.run(asyncio.wait_for(burst_gaps(due=False), 120)) > 3


def test_a_late_rank_yields_once_per_pass() -> None:
    """Passes that take 5 ms of the clock for 1 ms of modeled time: every deadline has passed
    when the pass ends, and the loop still lets another task run before the next pass."""

    async def scenario() -> None:
        clock = VirtualClock()

        class Delivery:
            finished = asyncio.Event()

            def deliver_outputs(
                self, rank: int, outputs: list[RequestOutput], decodes: Decodes
            ) -> None:
                if any(o.finish_reason is not None for o in outputs):
                    self.finished.set()

            def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
                pass

        delivery = Delivery()
        loop = engine_loop(
            delivery,
            clock=clock,
            sleep=clock.sleep,
            speedup_ratio=1.0,
            num_gpu_blocks=NUM_GPU_BLOCKS,
        )
        ticks = 0
        seen: list[int] = []

        def slow_pass(rank: int, now_ms: float, result: PassReport) -> None:
            seen.append(ticks)
            clock.now += 0.005

        loop.pass_observers.append(slow_pass)

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(loop.run()), asyncio.create_task(ticker())]
        try:
            await loop.call(Submit(Request(token_ids=[1] * 16, max_tokens=50, request_id="r")))
            await delivery.finished.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert len(seen) >= 50
        assert min(loop.lateness.ms) > 0  # every pass after the first started late
        assert all(b > a for a, b in itertools.pairwise(seen)), seen

    asyncio.run(asyncio.wait_for(scenario(), 30))


LATE_DAEMON = (
    "--speedup-ratio",
    "1",
    "--perf-model",
    "fixed",
    "--fixed-prefill-ms-per-token",
    "0",
    "--fixed-pass-overhead-ms",
    "0",
    # A pass models 1 µs, far less than it takes to run: every pass of the rank is late.
    "--fixed-decode-ms-per-pass",
    "0.001",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "8192",
    "--drain-timeout",
    "1",
)


def test_a_late_daemon_answers_control_and_signals_while_busy(tmp_path: Path) -> None:
    """A daemon whose every pass is late still answers a ping and `stats` and handles
    SIGTERM; after the drain every request has exactly one terminal.

    The streamer reads with a raw socket and msgspec only: EngineClient's per-entry dispatch
    in Python cannot keep up with an unpaced compiled daemon (about a million entries a
    second here), and a client far behind when the daemon exits can lose the tail of its
    stream, terminals included (README, Limits). Its reader runs from the first submit on.
    """
    daemon = DaemonProcess(tmp_path, list(LATE_DAEMON), None)
    requests = [f"r{i}" for i in range(512)]

    async def load_then_probe() -> dict[str, str | None]:
        ctx = zmq.asyncio.Context()
        streamer = ctx.socket(zmq.DEALER)
        streamer.setsockopt(zmq.LINGER, 0)
        streamer.connect(daemon.control)
        decoder = wire.ReplyDecoder()
        submitted: set[str] = set()
        reasons: dict[str, str | None] = {}
        all_submitted = asyncio.Event()
        all_ended = asyncio.Event()

        async def read() -> None:
            while True:
                message = decoder.decode((await streamer.recv_multipart())[-1])
                if isinstance(message, wire.Submitted):
                    submitted.add(message.request_id)
                    if len(submitted) == len(requests):
                        all_submitted.set()
                elif isinstance(message, wire.Output):
                    for entry in message.outputs:
                        if entry.finished:
                            assert entry.request_id not in reasons, entry
                            reasons[entry.request_id] = entry.finish_reason
                    if len(reasons) == len(requests):
                        all_ended.set()

        reader = asyncio.create_task(read())
        try:
            for i, request_id in enumerate(requests):
                # 30,000 tokens each: 15 M in all, more than even the compiled core emits
                # before SIGTERM plus the 1 s drain (with 3,000 it drained them all in time).
                request = wire.WireRequest(
                    request_id=request_id, token_ids=[i] * 16, max_tokens=30_000
                )
                await streamer.send_multipart([wire.encode_message(wire.Submit(request=request))])
            await asyncio.wait_for(all_submitted.wait(), 30)
            async with await EngineClient.connect(daemon.control) as prober:
                # The rank is late from its first pass on; the probe is answered between passes.
                await prober.ping(timeout=30)
                stats = await prober.stats(timeout=30)
            assert stats.ranks[0].running + stats.ranks[0].waiting > 0
            assert stats.ranks[0].lateness_max_ms > 0
            # SIGTERM is handled while the work is still there: the drain timeout ends it.
            daemon.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(all_ended.wait(), 30)
            return reasons
        finally:
            reader.cancel()
            streamer.close()
            ctx.term()

    try:
        daemon.wait_ready()
        reasons = asyncio.run(load_then_probe())
        assert daemon.stop(timeout=30) == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.stop(signal.SIGKILL)
    assert set(reasons) == set(requests)
    assert "cancelled" in reasons.values(), daemon.log()
