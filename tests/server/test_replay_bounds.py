"""Replay clients that never read cost bounded memory and nobody else's time (issue 10, 3).

1. A client asks twice for the whole buffer and never reads: the daemon queues it at most
   its high-water mark of batches (what it finally reads is bounded by that, not by the
   buffer), abandons the replay once it stalled for the stall timeout (on a virtual clock),
   and drops its second request with it.
2. The same next to a client that reads (on the real clock, with a short stall timeout): the
   reader gets its whole replay, only the stalled client is abandoned.
3. Streams are capped: beyond MAX_STREAMS replays wait for a slot, and beyond MAX_WAITING
   they are refused and counted.
4. The ring buffer: contiguous seqs, eviction, lookups.
5. A real daemon: twenty DEALERs ask twice from seq 0 and never read; the daemon's RSS grows
   by a bounded amount (the figure is memory, not time), it keeps answering ping, and a
   reading client still replays everything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.core import types as core
from engined.server.publish import kv_replay
from engined.server.publish.kv_publisher import KvPublisher
from engined.server.publish.kv_replay import ReplayBuffer
from engined.wire.kv_events import REPLAY_END_SEQ, read_seq, seq_bytes
from engined.zmq_sockets import SocketRegistry
from tests.server.daemon_harness import DaemonProcess
from tests.server.virtual_clock import VirtualClock
from tests.support import until

BATCH_TOKENS = 256  # one batch is ~1.3 KB
BUFFERED = 2_000


def stored(n: int) -> list[core.KvEvent]:
    hashes = [2**40 + n]
    return [core.BlockStored(n, 0, None, hashes, hashes, list(range(BATCH_TOKENS)), BATCH_TOKENS)]


@contextlib.asynccontextmanager
async def publisher(
    tmp_path: Path, clock: VirtualClock | None, **kwargs: Any
) -> AsyncIterator[tuple[zmq.asyncio.Context, KvPublisher]]:
    timing: dict[str, Any] = {} if clock is None else {"clock": clock, "sleep": clock.sleep}
    ctx = zmq.asyncio.Context()
    registry = SocketRegistry()
    pub = KvPublisher(
        ctx,
        registry,
        endpoint=f"ipc://{tmp_path}/kv",
        bind=True,
        topic="",
        fmt="vllm",
        dp_rank=0,
        replay_endpoint=f"ipc://{tmp_path}/replay",
        replay_buffer=BUFFERED,
        **timing,
        **kwargs,
    )
    try:
        pub.start()
        yield ctx, pub
    finally:
        await pub.close()
        registry.close()
        ctx.destroy(linger=0)


def dealer(ctx: zmq.asyncio.Context, endpoint: str, rcvhwm: int = 1000) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.connect(endpoint)
    return sock


async def read_replay(sock: zmq.asyncio.Socket) -> list[int]:
    seqs: list[int] = []
    while True:
        _, _topic, seq, _payload = await asyncio.wait_for(sock.recv_multipart(), 10)
        if seq == REPLAY_END_SEQ:
            return seqs
        seqs.append(read_seq(seq))


def test_a_client_that_never_reads_is_bounded_and_abandoned(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = VirtualClock()
        # 64 KB per client at (at most) 2 KB per batch: 32 batches in flight.
        async with publisher(tmp_path, clock, replay_client_bytes=64 * 1024, batch_bytes=2048) as (
            ctx,
            pub,
        ):
            assert pub.replay_hwm == 32
            for n in range(BUFFERED):
                pub.publish(stored(n), 1.0)
            replay = pub.replay
            assert replay is not None
            endpoint = pub.replay_endpoint or ""
            stalled = dealer(ctx, endpoint, rcvhwm=8)
            for _ in range(2):
                await stalled.send_multipart([b"", seq_bytes(0)])
            await until(lambda: replay.abandoned == 1, poll_s=0.001)
            assert clock() >= kv_replay.STALL_TIMEOUT_S
            # The passes go on while a replay stalls: publishing never waited.
            pub.publish(stored(BUFFERED), 1.0)
            # What the stalled client was sent: its high-water mark, its own receive queue
            # and the socket buffers between them, not the buffer twice over.
            received = 0
            while await stalled.poll(200):
                await stalled.recv_multipart()
                received += 1
            assert 0 < received < BUFFERED // 4, received
            assert replay.streaming == 0
            # Abandoned, its second request went with it; a new request is served afresh.
            await stalled.send_multipart([b"", seq_bytes(BUFFERED)])
            assert await read_replay(stalled) == [BUFFERED]
            stalled.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_reading_client_is_served_next_to_a_stalled_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with publisher(
            tmp_path,
            None,
            replay_client_bytes=64 * 1024,
            batch_bytes=2048,
            # Real time: a reader is never this slow, the stalled client always is.
            replay_stall_timeout_s=2.0,
        ) as (ctx, pub):
            for n in range(BUFFERED):
                pub.publish(stored(n), 1.0)
            replay = pub.replay
            assert replay is not None
            endpoint = pub.replay_endpoint or ""
            stalled = dealer(ctx, endpoint, rcvhwm=8)
            await stalled.send_multipart([b"", seq_bytes(0)])
            reader = dealer(ctx, endpoint)
            await reader.send_multipart([b"", seq_bytes(0)])
            assert await read_replay(reader) == list(range(BUFFERED))
            await until(lambda: replay.abandoned == 1, poll_s=0.001)
            assert replay.streaming == 0
            stalled.close()
            reader.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_streams_are_capped_and_excess_requests_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_replay, "MAX_STREAMS", 2)
    monkeypatch.setattr(kv_replay, "MAX_WAITING", 1)

    async def scenario() -> None:
        clock = VirtualClock()
        async with publisher(tmp_path, clock, replay_client_bytes=16 * 1024, batch_bytes=2048) as (
            ctx,
            pub,
        ):
            for n in range(BUFFERED):
                pub.publish(stored(n), 1.0)
            replay = pub.replay
            assert replay is not None
            endpoint = pub.replay_endpoint or ""
            clients = [dealer(ctx, endpoint, rcvhwm=4) for _ in range(4)]
            for client in clients:
                await client.send_multipart([b"", seq_bytes(0)])
            await until(lambda: replay.refused == 1, poll_s=0.001)
            assert replay.streaming == 2
            # The two stalled streams are abandoned; the waiting client then gets a slot.
            await until(lambda: replay.abandoned >= 2, poll_s=0.001)
            await until(lambda: replay.abandoned == 3 and replay.streaming == 0, poll_s=0.001)
            for client in clients:
                client.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_replay_buffer_ring() -> None:
    ring = ReplayBuffer(3)
    assert (len(ring), ring.oldest, ring.next_seq) == (0, 0, 0)
    for n in range(5):
        ring.append(n, bytes([n]))
    assert (len(ring), ring.oldest, ring.next_seq) == (3, 2, 5)
    assert [ring.get(n) for n in range(6)] == [None, None, b"\x02", b"\x03", b"\x04", None]
    with pytest.raises(ValueError, match="expects seq 5"):
        ring.append(7, b"")
    empty = ReplayBuffer(0)
    empty.append(0, b"x")
    assert (len(empty), empty.oldest, empty.next_seq, empty.get(0)) == (0, 1, 1, None)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


REPLAY_DAEMON = (
    "--speedup-ratio",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "64",
    "--kv-replay-buffer",
    "3000",
    "--kv-replay-client-bytes",
    str(256 * 1024),
)


def test_twenty_clients_that_never_read_cost_bounded_memory(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, list(REPLAY_DAEMON), None)

    async def scenario() -> tuple[int, int, int]:
        ctx = zmq.asyncio.Context()
        try:
            async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
                # Fill the replay buffer: batches of 16 stored and 16 evicted blocks each.
                for start in range(0, 1500, 2):
                    await asyncio.gather(
                        *(
                            client.generate([n * 1000 + t for t in range(256)], 1)
                            for n in range(start, start + 2)
                        )
                    )
                before = rss_kb(daemon.proc.pid)
                stalled = [dealer(ctx, daemon.replay, rcvhwm=8) for _ in range(20)]
                for sock in stalled:
                    for _ in range(2):
                        await sock.send_multipart([b"", seq_bytes(0)])
                reader = dealer(ctx, daemon.replay)
                await reader.send_multipart([b"", seq_bytes(0)])
                seqs = await read_replay(reader)
                await client.ping(timeout=10)
                after = rss_kb(daemon.proc.pid)
                for sock in [*stalled, reader]:
                    sock.close()
                assert seqs == list(range(seqs[-1] + 1))
                return before, after, len(seqs)
        finally:
            ctx.destroy(linger=0)

    try:
        daemon.wait_ready()
        before, after, replayed = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        assert daemon.stop() == 0, daemon.log()
    # Each pair of requests runs to completion before the next is sent, so every pair's
    # prefill publishes at least one batch (how many more depends on how the pair's
    # submits fall into passes).
    assert replayed >= 750
    # 40 whole replays of a buffer of ~10 KB batches queued at once would be 400 MB and
    # more; bounded, each stalled client holds at most 256 KB here (~5 MB for twenty).
    assert after - before < 48 * 1024, (replayed, before, after)
