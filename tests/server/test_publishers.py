"""KV event and FPM publishers over real sockets: frames, seqs, replay, heartbeats.

Every wait is a `poll`/`recv` with a timeout. PUB/SUB drops what is published before a new
subscription is in place (the slow joiner), so subscriber tests first publish probes until one
arrives (`join_*`), then skip leftover probes by seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from engined.core import types as core
from engined.core.types import FpmSnapshot
from engined.server.publish.fpm_publisher import FpmPublisher, NullFpmPublisher
from engined.server.publish.kv_publisher import KvPublisher, NullKvPublisher
from engined.wire.fpm_schema import ForwardPassMetrics, decode_fpm
from engined.wire.kv_events import (
    REPLAY_END_SEQ,
    ArrayBlockStored,
    BlockStored,
    KvEventEncoder,
    KvEventFormat,
    decode_batch,
    seq_bytes,
)
from engined.zmq_sockets import SocketRegistry, make_socket
from tests.support import free_tcp_port

WAIT_S = 5.0
PROBE_POLL_MS = 20
TS = 1757500000.25
HASH = 0xF00DFACECAFEBEEF


def async_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (pytest-asyncio is not installed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=30))

    return wrapper


@contextlib.asynccontextmanager
async def zmq_env() -> AsyncIterator[tuple[zmq.asyncio.Context, SocketRegistry]]:
    """A context and a registry owning every socket of the test, torn down in order."""
    ctx = zmq.asyncio.Context()
    registry = SocketRegistry()
    try:
        yield ctx, registry
    finally:
        registry.close()
        ctx.term()


def ipc(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path / name}"


def stored(n: int) -> core.BlockStored:
    """A distinct one-block store event; `n` shows up as its token ids."""
    return core.BlockStored(
        event_id=n,
        dp_rank=0,
        parent_hash=None,
        block_hashes=[HASH + n],
        local_hashes=[n],
        token_ids=[n, n, n, n],
        block_size=4,
    )


PROBE: Sequence[core.KvEvent] = (core.AllBlocksCleared(event_id=0, dp_rank=0),)


async def recv(sock: zmq.asyncio.Socket, timeout: float = WAIT_S) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), timeout)
    return frames


def make_sub(
    ctx: zmq.asyncio.Context, registry: SocketRegistry, endpoint: str, *, bind: bool = False
) -> zmq.asyncio.Socket:
    sub = registry.make(ctx, zmq.SUB, endpoint, bind=bind, linger=0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


async def join_kv(pub: KvPublisher, sub: zmq.asyncio.Socket) -> int:
    """Publish probe batches until `sub` gets one; returns the first seq after the probes."""
    for _ in range(int(WAIT_S * 1000 / PROBE_POLL_MS)):
        pub.publish(PROBE, TS)
        if await sub.poll(timeout=PROBE_POLL_MS):
            await recv(sub)
            return pub.next_seq
    raise AssertionError("subscriber never received a probe")


async def recv_kv(sub: zmq.asyncio.Socket, first_seq: int) -> list[bytes]:
    """The next message with seq >= first_seq (probes still in flight are skipped)."""
    while True:
        frames = await recv(sub)
        if int.from_bytes(frames[1], "big") >= first_seq:
            return frames


async def replay(
    ctx: zmq.asyncio.Context, registry: SocketRegistry, endpoint: str, request: Sequence[bytes]
) -> list[list[bytes]]:
    """Send one replay request from a fresh DEALER; every reply up to the end marker."""
    dealer = registry.make(ctx, zmq.DEALER, endpoint, bind=False, linger=0)
    await dealer.send_multipart(request)
    replies = []
    while True:
        frames = await recv(dealer)
        replies.append(frames)
        if frames[-1] == b"" and frames[-2] == REPLAY_END_SEQ:
            return replies


END_MARKER = [b"", b"", REPLAY_END_SEQ, b""]


def kv_publisher(
    ctx: zmq.asyncio.Context,
    registry: SocketRegistry,
    tmp_path: Path,
    *,
    replay_buffer: int = 100,
    fmt: KvEventFormat = "vllm",
    topic: str = "kv@test",
    dp_rank: int = 0,
) -> KvPublisher:
    return KvPublisher(
        ctx,
        registry,
        endpoint=ipc(tmp_path, "kv"),
        bind=True,
        topic=topic,
        fmt=fmt,
        dp_rank=dp_rank,
        replay_endpoint=ipc(tmp_path, "replay"),
        replay_buffer=replay_buffer,
    )


class TestKvPublisher:
    @pytest.mark.parametrize("fmt", ["vllm", "vllm-array"])
    @async_test
    async def test_frames_payload_and_contiguous_seqs(
        self, tmp_path: Path, fmt: KvEventFormat
    ) -> None:
        """1. subscribe and join; 2. publish three batches; 3. replay everything.

        Result: frames are [topic, seq(8B BE), payload]; the payload is the encoder's for the
        events with the publisher's rank; seqs run 0, 1, 2, ... without a gap.
        """
        async with zmq_env() as (ctx, registry):
            pub = kv_publisher(ctx, registry, tmp_path, fmt=fmt, dp_rank=3)
            sub = make_sub(ctx, registry, pub.endpoint)
            first = await join_kv(pub, sub)
            encoder = KvEventEncoder(fmt)
            for n in range(3):
                pub.publish([stored(n)], TS + n)
            for n in range(3):
                topic, seq, payload = await recv_kv(sub, first + n)
                assert topic == b"kv@test"
                assert seq == seq_bytes(first + n)
                assert payload == encoder.encode_batch(TS + n, [stored(n)], 3)
                batch = decode_batch(payload)
                assert batch.data_parallel_rank == 3
                assert batch.ts == TS + n
                (event,) = batch.events
                assert isinstance(event, BlockStored if fmt == "vllm" else ArrayBlockStored)
                assert event.token_ids == [n] * 4
            pub.start()
            replies = await replay(ctx, registry, pub.replay_endpoint or "", [b"", seq_bytes(0)])
            assert replies[-1] == END_MARKER
            assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == list(range(first + 3))
            await pub.close()

    @async_test
    async def test_empty_batch_publishes_nothing_and_consumes_no_seq(self, tmp_path: Path) -> None:
        """1. join; 2. publish [], then one batch. Result: the batch is the next seq."""
        async with zmq_env() as (ctx, registry):
            pub = kv_publisher(ctx, registry, tmp_path)
            sub = make_sub(ctx, registry, pub.endpoint)
            first = await join_kv(pub, sub)
            pub.publish([], TS)
            assert pub.next_seq == first
            pub.publish([stored(7)], TS)
            _, seq, payload = await recv_kv(sub, first)
            assert seq == seq_bytes(first)
            assert decode_batch(payload).events[0].token_ids == [7] * 4  # type: ignore[union-attr]
            assert pub.next_seq == first + 1

    @pytest.mark.parametrize(
        ("start", "expected"),
        [(0, [0, 1, 2, 3, 4]), (2, [2, 3, 4]), (4, [4]), (5, []), (2**64 - 2, [])],
        ids=["from-0", "from-middle", "last", "past-end", "far-past-end"],
    )
    @async_test
    async def test_replay(self, tmp_path: Path, start: int, expected: list[int]) -> None:
        """1. publish five batches (no subscriber); 2. replay from `start`.

        Result: [b"", topic, seq, payload] for every buffered seq >= start, in order, then the
        end marker; a start past the newest seq gets only the end marker.
        """
        async with zmq_env() as (ctx, registry):
            pub = kv_publisher(ctx, registry, tmp_path)
            pub.start()
            encoder = KvEventEncoder("vllm")
            for n in range(5):
                pub.publish([stored(n)], TS)
            replies = await replay(
                ctx, registry, pub.replay_endpoint or "", [b"", seq_bytes(start)]
            )
            assert replies == [
                [b"", b"kv@test", seq_bytes(n), encoder.encode_batch(TS, [stored(n)], 0)]
                for n in expected
            ] + [END_MARKER]
            await pub.close()

    @async_test
    async def test_buffer_keeps_only_the_newest(self, tmp_path: Path) -> None:
        """1. buffer of 3; 2. publish 5; 3. replay from 0. Result: seqs 2, 3, 4 (no error)."""
        async with zmq_env() as (ctx, registry):
            pub = kv_publisher(ctx, registry, tmp_path, replay_buffer=3)
            pub.start()
            for n in range(5):
                pub.publish([stored(n)], TS)
            replies = await replay(ctx, registry, pub.replay_endpoint or "", [b"", seq_bytes(0)])
            expected = [seq_bytes(2), seq_bytes(3), seq_bytes(4), REPLAY_END_SEQ]
            assert [r[2] for r in replies] == expected
            await pub.close()

    @pytest.mark.parametrize(
        "request_frames",
        [
            [b"", b"\x00\x01"],  # seq too short
            [b"", b"\x00" * 9],  # seq too long
            [b"\x00" * 8],  # no delimiter (2 frames at the ROUTER)
            [b"", seq_bytes(0), b"extra"],  # 4 frames at the ROUTER
            [b"x", seq_bytes(0)],  # non-empty delimiter
        ],
        ids=["short-seq", "long-seq", "no-delimiter", "extra-frame", "bad-delimiter"],
    )
    @async_test
    async def test_malformed_replay_request_gets_end_marker(
        self, tmp_path: Path, request_frames: list[bytes]
    ) -> None:
        """1. publish 2 batches; 2. send a malformed request; 3. send a valid one.

        Result: the malformed one gets only the end marker; the task keeps serving.
        """
        async with zmq_env() as (ctx, registry):
            pub = kv_publisher(ctx, registry, tmp_path)
            pub.start()
            pub.publish([stored(0)], TS)
            pub.publish([stored(1)], TS)
            endpoint = pub.replay_endpoint or ""
            replies = await replay(ctx, registry, endpoint, request_frames)
            assert replies[-1][-3:] == END_MARKER[-3:]
            assert len(replies) == 1
            replies = await replay(ctx, registry, endpoint, [b"", seq_bytes(1)])
            assert [r[2] for r in replies] == [seq_bytes(1), REPLAY_END_SEQ]
            (task,) = pub.tasks
            assert not task.done()
            await pub.close()
            assert pub.tasks == ()

    @async_test
    async def test_connect_mode_reaches_a_bound_subscriber(self, tmp_path: Path) -> None:
        """1. a collector binds a SUB; 2. the publisher connects to it (bind=False).

        Result: the collector receives the batches.
        """
        async with zmq_env() as (ctx, registry):
            collector = ipc(tmp_path, "collector")
            sub = make_sub(ctx, registry, collector, bind=True)
            pub = KvPublisher(
                ctx,
                registry,
                endpoint=collector,
                bind=False,
                topic="",
                fmt="vllm",
                dp_rank=1,
                replay_endpoint=None,
                replay_buffer=0,
            )
            assert pub.endpoint == collector
            assert pub.replay_endpoint is None
            first = await join_kv(pub, sub)
            pub.publish([stored(5)], TS)
            topic, seq, payload = await recv_kv(sub, first)
            assert (topic, seq) == (b"", seq_bytes(first))
            assert decode_batch(payload).data_parallel_rank == 1
            pub.start()  # no replay: nothing to run
            assert pub.tasks == ()
            await pub.close()

    @async_test
    async def test_tcp_with_ephemeral_ports(self) -> None:
        """1. bind PUB and replay on free 127.0.0.1 ports; 2. subscribe, replay over tcp."""
        async with zmq_env() as (ctx, registry):
            kv_port, replay_port = free_tcp_port(), free_tcp_port()
            pub = KvPublisher(
                ctx,
                registry,
                endpoint=f"tcp://127.0.0.1:{kv_port}",
                bind=True,
                topic="",
                fmt="vllm",
                dp_rank=0,
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                replay_buffer=10,
            )
            assert pub.endpoint == f"tcp://127.0.0.1:{kv_port}"
            assert pub.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
            pub.start()
            sub = make_sub(ctx, registry, pub.endpoint)
            first = await join_kv(pub, sub)
            pub.publish([stored(9)], TS)
            _, seq, _ = await recv_kv(sub, first)
            assert seq == seq_bytes(first)
            replies = await replay(ctx, registry, pub.replay_endpoint, [b"", seq_bytes(first)])
            assert [r[2] for r in replies] == [seq_bytes(first), REPLAY_END_SEQ]
            await pub.close()

    @async_test
    async def test_wildcard_port_reports_the_bound_endpoint(self) -> None:
        async with zmq_env() as (ctx, registry):
            pub = KvPublisher(
                ctx,
                registry,
                endpoint="tcp://127.0.0.1:*",
                bind=True,
                topic="",
                fmt="vllm",
                dp_rank=0,
                replay_endpoint="tcp://127.0.0.1:*",
                replay_buffer=1,
            )
            assert pub.endpoint.startswith("tcp://127.0.0.1:")
            assert not pub.endpoint.endswith("*")
            assert pub.replay_endpoint is not None
            assert pub.replay_endpoint != pub.endpoint

    @async_test
    async def test_null_publisher(self) -> None:
        pub = NullKvPublisher()
        pub.start()
        pub.publish([stored(0)], TS)
        assert pub.next_seq == 0
        assert pub.tasks == ()
        await pub.close()


# --- FPM ------------------------------------------------------------------------------------

SNAPSHOT = FpmSnapshot(
    num_prefill_requests=2,
    sum_prefill_tokens=300,
    num_decode_requests=1,
    sum_decode_kv_tokens=40,
    num_queued_prefill=1,
    sum_queued_prefill_tokens=64,
    wall_time_secs=0.0125,
)


async def join_fpm(pub: FpmPublisher, sub: zmq.asyncio.Socket) -> int:
    for _ in range(int(WAIT_S * 1000 / PROBE_POLL_MS)):
        pub.publish(SNAPSHOT)
        if await sub.poll(timeout=PROBE_POLL_MS):
            await recv(sub)
            return pub.next_seq
    raise AssertionError("subscriber never received a probe")


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def is_heartbeat(payload: bytes) -> bool:
    m = decode_fpm(payload)
    return (
        m.wall_time == 0.0
        and m.scheduled_requests == type(m.scheduled_requests)()
        and m.queued_requests == type(m.queued_requests)()
    )


class TestFpmPublisher:
    @async_test
    async def test_frames_and_counter_id_is_seq(self, tmp_path: Path) -> None:
        """1. join; 2. publish two snapshots.

        Result: frames [b"", seq, payload]; counter_id == seq; worker id and rank stamped.
        """
        async with zmq_env() as (ctx, registry):
            pub = FpmPublisher(
                ctx, registry, endpoint=ipc(tmp_path, "fpm"), worker_id="w-1", dp_rank=2
            )
            sub = make_sub(ctx, registry, pub.endpoint)
            first = await join_fpm(pub, sub)
            pub.publish(SNAPSHOT)
            pub.publish(SNAPSHOT)
            got: list[tuple[bytes, ForwardPassMetrics]] = []
            while len(got) < 2:
                topic, seq, payload = await recv(sub)
                assert topic == b""
                if int.from_bytes(seq, "big") >= first:
                    got.append((seq, decode_fpm(payload)))
            for i, (seq, metrics) in enumerate(got):
                assert seq == seq_bytes(first + i)
                assert metrics.counter_id == first + i
                assert (metrics.worker_id, metrics.dp_rank) == ("w-1", 2)
                assert metrics.wall_time == 0.0125
                assert metrics.scheduled_requests.sum_prefill_tokens == 300
                assert metrics.queued_requests.sum_prefill_tokens == 64

    @async_test
    async def test_heartbeat_deadlines(self, tmp_path: Path) -> None:
        """Heartbeat 1 s after the last message, then every second; a pass postpones it.

        1. fake clock at 100 (no task); 2. call maybe_heartbeat at chosen times.
        Result: heartbeats at 101 and 102; after a pass at 102.3 the next is at 103.3; each
        heartbeat is all zero with counter_id == its seq.
        """
        async with zmq_env() as (ctx, registry):
            clock = FakeClock(100.0)
            pub = FpmPublisher(
                ctx,
                registry,
                endpoint=ipc(tmp_path, "fpm"),
                worker_id="w",
                dp_rank=0,
                clock=clock,
            )
            sub = make_sub(ctx, registry, pub.endpoint)
            first = await join_fpm(pub, sub)  # publishes passes at clock 100
            assert pub.next_heartbeat_at == 101.0

            def heartbeat_sent(now: float) -> bool:
                clock.now = now
                before = pub.next_seq
                pub.maybe_heartbeat(now)
                return pub.next_seq == before + 1

            assert [heartbeat_sent(t) for t in (100.5, 101.0, 101.5, 102.0)] == [
                False,
                True,
                False,
                True,
            ]
            clock.now = 102.3
            pub.publish(SNAPSHOT)
            assert pub.next_heartbeat_at == pytest.approx(103.3)
            assert not heartbeat_sent(103.0)
            assert heartbeat_sent(103.3)

            kinds: list[tuple[int, bool]] = []
            while len(kinds) < 4:
                _, seq, payload = await recv(sub)
                n = int.from_bytes(seq, "big")
                if n >= first:
                    assert decode_fpm(payload).counter_id == n
                    kinds.append((n - first, is_heartbeat(payload)))
            assert kinds == [(0, True), (1, True), (2, False), (3, True)]

    @async_test
    async def test_null_publisher(self) -> None:
        pub = NullFpmPublisher()
        pub.publish(SNAPSHOT)
        pub.heartbeat()
        pub.maybe_heartbeat(1e9)
        assert pub.next_seq == 0


# --- socket factory and registry --------------------------------------------------------------


class TestSockets:
    @async_test
    async def test_options_are_applied(self, tmp_path: Path) -> None:
        async with zmq_env() as (ctx, registry):
            sock = registry.make(
                ctx,
                zmq.ROUTER,
                ipc(tmp_path, "r"),
                bind=True,
                sndhwm=7,
                rcvhwm=8,
                linger=9,
                maxmsgsize=1024,
                router_mandatory=True,
            )
            assert sock.getsockopt(zmq.SNDHWM) == 7
            assert sock.getsockopt(zmq.RCVHWM) == 8
            assert sock.getsockopt(zmq.LINGER) == 9
            assert sock.getsockopt(zmq.MAXMSGSIZE) == 1024
            dealer = registry.make(
                ctx, zmq.DEALER, ipc(tmp_path, "r"), bind=False, routing_id=b"me"
            )
            assert dealer.getsockopt(zmq.ROUTING_ID) == b"me"
            assert len(registry) == 2

    @async_test
    async def test_router_mandatory_needs_a_router(self, tmp_path: Path) -> None:
        async with zmq_env() as (ctx, _):
            with pytest.raises(ValueError, match="router_mandatory"):
                make_socket(ctx, zmq.PUB, ipc(tmp_path, "p"), bind=True, router_mandatory=True)

    @async_test
    async def test_failed_bind_closes_the_socket(self) -> None:
        async with zmq_env() as (ctx, registry):
            port = free_tcp_port()
            registry.make(ctx, zmq.PUB, f"tcp://127.0.0.1:{port}", bind=True)
            with pytest.raises(zmq.ZMQError):
                registry.make(ctx, zmq.PUB, f"tcp://127.0.0.1:{port}", bind=True)
            assert len(registry) == 1
        # ctx.term() returned: no socket was left open.

    def test_registry_closes_in_reverse_order_once(self) -> None:
        closed: list[str] = []

        class Fake:
            def __init__(self, name: str) -> None:
                self.name = name

            def close(self, linger: int | None = None) -> None:
                closed.append(self.name)

        registry = SocketRegistry()
        for name in ("a", "b", "c"):
            registry.add(Fake(name))  # type: ignore[arg-type]
        registry.close()
        registry.close()
        assert closed == ["c", "b", "a"]
        assert registry.closed
        with pytest.raises(RuntimeError, match="closed"):
            registry.add(Fake("late"))  # type: ignore[arg-type]
        assert closed[-1] == "late"  # refused, but not leaked
