"""Replay: a subscriber that joins late or drops messages recovers every batch through the
replay socket; seq is contiguous.

Each test runs a real `engined serve` with prefix caching on and a small KV pool (so the
stream has stores, evictions and a cache reset), and reads its KV PUB and replay sockets with
raw ZeroMQ sockets (`Subscriber` below), so every seq and payload byte is visible. The daemon's
PUB keeps up to 100,000 batches per subscriber (vLLM's hwm), so a subscriber only loses
batches published before it joined or while it was disconnected; the tests make those losses
certain instead of hoping for them.

Every wait is bounded: replies and PUB messages are awaited with timeouts, subscribers are
polled with deadlines, and each scenario runs under `asyncio.wait_for`. No sleep is used to
synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient, Generation
from engined.wire.kv_events import (
    REPLAY_END_SEQ,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    decode_batch,
    read_seq,
    seq_bytes,
)
from tests.reference_indexer import ReferenceIndexer
from tests.server.daemon_harness import (
    DaemonProcess,
    KvStream,
    assert_each_prompt_on_its_rank,
    start_daemon,
    to_core_events,
)
from tests.support import run

SCENARIO_TIMEOUT_S = 60.0
WAIT_S = 10.0
POLL_MS = 20
BLOCK_SIZE = 16
# 48 blocks of 16 tokens: the workload below overflows it, so cached blocks get evicted.
FLAGS = ("--speedup-ratio", "0", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", "48")


def prompts(start: int, count: int, *, shared: bool = True) -> list[list[int]]:
    """Prompts of 40 to 120 tokens; with `shared`, consecutive pairs share a 32-token prefix
    (cache hits), else no two prompts share a block."""
    out = []
    for i in range(start, start + count):
        prefix = [900_000 + (i // 2 if shared else i) * 100 + t for t in range(32)]
        out.append(prefix + [i * 1000 + t for t in range(8 + (i % 5) * 20)])
    return out


async def workload(client: EngineClient, start: int, count: int) -> None:
    """Requests one after the other (so the event stream is deterministic), all complete."""
    for tokens in prompts(start, count):
        gen = await client.generate(tokens, 12, timeout=WAIT_S)
        assert (len(gen.token_ids), gen.finish_reason) == (12, "length")


class Subscriber:
    """A raw SUB on a rank's KV PUB plus a DEALER on its replay socket.

    `live` maps each seq that arrived on the PUB socket to its payload; `replayed` each seq
    taken from a replay reply; `batches()` is their union. A live message past `next_seq`
    is a gap, filled at once from the replay socket, as vLLM consumers do.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str,
        *,
        rcvhwm: int | None = None,
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._rcvhwm = rcvhwm
        self._sub = self._connect()
        self._replay = ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self.next_seq = 0
        self.live: dict[int, bytes] = {}
        self.replayed: dict[int, bytes] = {}
        self.gaps: list[tuple[int, int]] = []  # (expected seq, seq that arrived)

    def _connect(self) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        if self._rcvhwm is not None:
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._endpoint)
        return sub

    def disconnect(self) -> None:
        """Close the SUB: whatever the PUB sends until `reconnect()` is lost to us."""
        self._sub.close()

    def reconnect(self) -> None:
        self._sub = self._connect()

    def close(self) -> None:
        self._sub.close()
        self._replay.close()

    def batches(self) -> dict[int, bytes]:
        return {**self.replayed, **self.live}

    async def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """One replay request: every (seq, payload) up to the end marker, seqs contiguous."""
        await self._replay.send_multipart([b"", seq_bytes(start)])
        replies: list[tuple[int, bytes]] = []
        while True:
            frames = await asyncio.wait_for(self._replay.recv_multipart(), WAIT_S)
            assert len(frames) == 4 and frames[0] == b"", frames
            _, topic, seq_frame, payload = frames
            if seq_frame == REPLAY_END_SEQ:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b""
            replies.append((read_seq(seq_frame), payload))
        seqs = [seq for seq, _ in replies]
        if seqs:
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        return replies

    async def recover(self) -> None:
        """Take every batch from `next_seq` on from the replay socket."""
        for seq, payload in await self.replay_from(self.next_seq):
            assert seq == self.next_seq, f"replay from {self.next_seq} started at {seq}"
            self.replayed[seq] = payload
            self.next_seq += 1

    async def pump(self, timeout_ms: int = POLL_MS) -> int:
        """Read what the PUB delivered (until `timeout_ms` of silence); returns the count."""
        count = 0
        while await self._sub.poll(timeout_ms):
            topic, seq_frame, payload = await self._sub.recv_multipart()
            assert topic == b""
            seq = read_seq(seq_frame)
            count += 1
            if seq > self.next_seq:
                self.gaps.append((self.next_seq, seq))
                await self.recover()
            if seq == self.next_seq:
                self.live[seq] = payload
                self.next_seq += 1
            elif seq in self.replayed:
                # Replay got there first; the live copy must be the same message.
                assert self.replayed[seq] == payload
                self.live[seq] = payload
        return count

    async def wait_for_seq(self, seq: int) -> None:
        """Pump until the PUB has delivered `seq` (or a later one), or fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not self.live or max(self.live) < seq:
            if time.monotonic() > deadline:
                raise AssertionError(f"seq {seq} never arrived on the PUB socket")
            await self.pump()

    async def join(self, client: EngineClient) -> None:
        """Run probe requests until one of their batches arrives on the PUB socket."""
        deadline = time.monotonic() + WAIT_S
        probe = 0
        before = len(self.live)
        while len(self.live) == before:
            if time.monotonic() > deadline:
                raise AssertionError("the subscriber never received a batch")
            tokens = [800_000 + probe * 100 + t for t in range(BLOCK_SIZE * 2)]
            await client.generate(tokens, 1, timeout=WAIT_S)
            probe += 1
            await self.pump()


@contextlib.asynccontextmanager
async def session(daemon: DaemonProcess) -> AsyncIterator[tuple[zmq.asyncio.Context, EngineClient]]:
    ctx = zmq.asyncio.Context()
    try:
        async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
            yield ctx, client
    finally:
        ctx.term()


def assert_clean_stream(payloads: Sequence[bytes]) -> ReferenceIndexer:
    indexer = ReferenceIndexer(BLOCK_SIZE, vllm=True)
    indexer.apply(to_core_events([decode_batch(p) for p in payloads]))
    indexer.assert_clean()
    return indexer


def test_late_joiner_recovers_everything_from_seq_0(tmp_path: Path) -> None:
    """1. start the daemon; a reference subscriber E joins (probe requests until it gets a
       batch live) and reads live from then on;
    2. run 10 requests one after the other (N batches published so far);
    3. a late subscriber L connects; run 10 more requests; reset the prefix cache;
    4. L catches up: it reads live and fills its gaps by replay, and finally replays the tail;
       E reads live up to the newest seq.

    Result: L holds seqs 0..M-1 without a gap, at least N of them taken from replay (the
    ones published before it connected); E received every seq from its join on, live and
    without a gap; every batch both saw is byte-identical; the stream is clean for a router
    and holds stores, removals and the final AllBlocksCleared.
    """

    async def scenario(daemon: DaemonProcess) -> None:
        async with session(daemon) as (ctx, client):
            early = Subscriber(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
            late: Subscriber | None = None
            try:
                await early.join(client)
                joined_at = min(early.live)
                await workload(client, 0, 10)
                await early.pump()
                before_late = max(early.live) + 1
                late = Subscriber(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
                await workload(client, 10, 10)
                await client.reset_prefix_cache()
                await late.pump()
                await late.recover()
                newest = late.next_seq - 1
                await early.wait_for_seq(newest)

                assert sorted(late.batches()) == list(range(newest + 1))
                assert set(range(before_late)) <= set(late.replayed)
                assert sorted(early.live) == list(range(joined_at, newest + 1))
                for seq, payload in early.live.items():
                    assert late.batches()[seq] == payload, f"seq {seq} differs"
                payloads = [late.batches()[seq] for seq in range(newest + 1)]
                indexer = assert_clean_stream(payloads)
                assert indexer.ok_count("stored") > 0
                assert indexer.ok_count("removed") > 0
                assert indexer.ok_count("cleared") == 1
            finally:
                early.close()
                if late is not None:
                    late.close()

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(scenario(daemon))


def test_dropping_subscriber_recovers_the_gaps(tmp_path: Path) -> None:
    """1. start the daemon; subscriber S with RCVHWM 1 joins;
    2. run 6 requests, S reads live;
    3. S disconnects; run 6 requests (their batches never reach S); S reconnects and runs
       probes until a batch arrives live;
    4. run 6 more requests; S reads live, then replays the tail;
    5. a fresh replay from seq 0.

    Result: S saw a gap (a live seq past the one it expected) and filled it from replay; S
    holds seqs 0..M-1 without a gap, byte-identical to the full replay, which starts at seq 0
    and is contiguous; the batches published while S was away came to it only by replay.
    """

    async def scenario(daemon: DaemonProcess) -> None:
        async with session(daemon) as (ctx, client):
            sub = Subscriber(ctx, daemon.kv_endpoint(), daemon.replay_endpoint(), rcvhwm=1)
            reference = Subscriber(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
            try:
                await sub.join(client)
                await workload(client, 0, 6)
                await sub.pump()
                away_from = sub.next_seq
                sub.disconnect()
                await workload(client, 6, 6)
                sub.reconnect()
                await sub.join(client)
                back_at = min(seq for seq in sub.live if seq >= away_from)
                await workload(client, 12, 6)
                await sub.pump()
                await sub.recover()

                assert sub.gaps, "the subscriber never saw a gap"
                assert back_at > away_from
                assert set(range(away_from, back_at)) <= set(sub.replayed) - set(sub.live)
                full = await reference.replay_from(0)
                assert [seq for seq, _ in full] == list(range(sub.next_seq))
                assert sub.batches() == dict(full)
                assert_clean_stream([payload for _, payload in full])
            finally:
                sub.close()
                reference.close()

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(scenario(daemon))


def test_replay_buffer_keeps_only_the_newest(tmp_path: Path) -> None:
    """1. start the daemon with --kv-replay-buffer 5; a subscriber E joins and reads live;
    2. run 12 requests; E reads live up to the newest seq (next - 1);
    3. replay from 0, from next-5, from next-4 and from next.

    Result: the replay from 0 starts at seq next-5 and holds exactly the last 5 batches,
    contiguous and byte-identical to what E received live; from next-5 the same; from next-4
    the last 4; from next only the end marker.
    """

    async def scenario(daemon: DaemonProcess) -> None:
        async with session(daemon) as (ctx, client):
            sub = Subscriber(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
            try:
                await sub.join(client)
                await workload(client, 0, 12)
                from_zero = await sub.replay_from(0)
                newest = from_zero[-1][0]
                await sub.wait_for_seq(newest)
                next_seq = newest + 1
                assert next_seq > 10, "the workload must publish more than the buffer holds"

                assert [seq for seq, _ in from_zero] == list(range(next_seq - 5, next_seq))
                for seq, payload in from_zero:
                    assert sub.live[seq] == payload
                assert await sub.replay_from(next_seq - 5) == from_zero
                assert await sub.replay_from(next_seq - 4) == from_zero[1:]
                assert await sub.replay_from(next_seq) == []
            finally:
                sub.close()

    with start_daemon(tmp_path, *FLAGS, "--kv-replay-buffer", "5") as daemon:
        run(scenario(daemon))


_ARRAY_FIELDS = {
    cls.__struct_config__.tag: [f.name for f in msgspec.structs.fields(cls)]
    for cls in (ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared)
}


def event_content(event: Any) -> tuple[str, dict[str, Any]]:
    """(kind, the fields the positional format has) of an event of either format."""
    kind = type(event).__name__.removeprefix("Array")
    return kind, {name: getattr(event, name) for name in _ARRAY_FIELDS[kind]}


def test_vllm_array_format_carries_the_same_events(tmp_path: Path) -> None:
    """1. start two daemons with the same engine flags, one with --kv-events-format vllm
       (default), one with vllm-array;
    2. run the same 16 requests one after the other on each, then reset the prefix cache;
    3. read each stream from seq 0 (KvStream: live plus replay) and decode every payload.

    Result: same number of batches; the array stream's events are the positional
    `Array*` structs and the map stream's the tagged ones; batch by batch, event by event,
    kind and content (block hashes, parent, token ids, block size, medium, ...) are equal;
    the array stream is clean for a router.
    """
    (tmp_path / "map").mkdir()
    (tmp_path / "array").mkdir()

    async def read(daemon: DaemonProcess) -> list[Any]:
        async with session(daemon) as (ctx, client):
            stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
            try:
                await workload(client, 0, 16)
                await client.reset_prefix_cache()
                await stream.catch_up()
            finally:
                stream.close()
            return stream.batches

    with (
        start_daemon(tmp_path / "map", *FLAGS) as map_daemon,
        start_daemon(tmp_path / "array", *FLAGS, "--kv-events-format", "vllm-array") as arr,
    ):
        map_batches = run(read(map_daemon))
        array_batches = run(read(arr))

    assert len(map_batches) == len(array_batches) > 10
    kinds = set()
    for map_batch, array_batch in zip(map_batches, array_batches, strict=True):
        assert map_batch.data_parallel_rank == array_batch.data_parallel_rank == 0
        assert len(map_batch.events) == len(array_batch.events)
        for map_event, array_event in zip(map_batch.events, array_batch.events, strict=True):
            assert type(array_event).__name__.startswith("Array")
            assert not type(map_event).__name__.startswith("Array")
            assert event_content(map_event) == event_content(array_event)
            kinds.add(event_content(map_event)[0])
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    indexer = ReferenceIndexer(BLOCK_SIZE, vllm=True)
    indexer.apply(to_core_events(array_batches))
    indexer.assert_clean()


def test_data_parallel_ranks_publish_separately(tmp_path: Path) -> None:
    """1. start the daemon with --data-parallel-size 2; open a KV stream per rank on the
       endpoints `welcome` lists;
    2. run 3 requests with dp_rank 1; catch both streams up;
    3. run 2 requests with dp_rank 0, then 4 without a dp_rank; catch both streams up.

    Result: `welcome` lists one KV and one replay endpoint per rank; after step 2 rank 0 has
    published nothing and rank 1's stream holds the 3 prompts; explicit ranks land on that
    rank (`submitted.dp_rank`); requests without a rank alternate between the ranks, two
    each; each prompt's blocks are indexed on its rank only; every batch carries its rank's
    `data_parallel_rank`; each rank's seqs run from 0 without a gap; both streams are clean.
    """

    async def submit_all(
        client: EngineClient, batch: list[list[int]], dp_rank: int | None
    ) -> list[Generation]:
        gens = []
        for tokens in batch:
            submitted = await client.submit(tokens, 4, dp_rank=dp_rank, timeout=WAIT_S)
            if dp_rank is not None:
                assert submitted.dp_rank == dp_rank
            gens.append(await client.collect(submitted, timeout=WAIT_S))
        return gens

    async def scenario(daemon: DaemonProcess) -> None:
        async with session(daemon) as (ctx, client):
            welcome = await client.hello()
            assert welcome.dp_size == 2
            assert welcome.kv_events_endpoints == [daemon.kv_endpoint(r) for r in (0, 1)]
            assert welcome.kv_replay_endpoints == [daemon.replay_endpoint(r) for r in (0, 1)]
            streams = [
                KvStream(ctx, daemon.kv_endpoint(r), daemon.replay_endpoint(r)) for r in (0, 1)
            ]
            try:
                pinned = prompts(0, 3, shared=False)
                await submit_all(client, pinned, 1)
                for stream in streams:
                    await stream.catch_up()
                assert streams[0].batches == []
                assert streams[1].batches

                explicit = prompts(3, 2, shared=False)
                await submit_all(client, explicit, 0)
                unpinned = prompts(5, 4, shared=False)
                gens = await submit_all(client, unpinned, None)
                ranks = [gen.dp_rank for gen in gens]
                assert ranks in ([0, 1, 0, 1], [1, 0, 1, 0]), ranks
                for stream in streams:
                    await stream.catch_up()

                indexer = ReferenceIndexer(BLOCK_SIZE, vllm=True)
                for rank, stream in enumerate(streams):
                    assert stream.next_seq == len(stream.batches)
                    assert {b.data_parallel_rank for b in stream.batches} == {rank}
                    indexer.apply(to_core_events(stream.batches))
                indexer.assert_clean()
                expected = [(t, 1) for t in pinned] + [(t, 0) for t in explicit]
                expected += [(t, r) for t, r in zip(unpinned, ranks, strict=True)]
                assert_each_prompt_on_its_rank(indexer, expected, BLOCK_SIZE)
            finally:
                for stream in streams:
                    stream.close()

    with start_daemon(tmp_path, *FLAGS, "--data-parallel-size", "2") as daemon:
        run(scenario(daemon))
