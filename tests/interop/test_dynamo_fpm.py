"""NVIDIA Dynamo 1.6.1 reads every forward-pass-metrics frame the daemon publishes.

A real `engined serve` (2 data-parallel ranks, 2 running requests per rank, a 64-token pass
budget so prefills are chunked and requests queue, prefix caching so prefills read cached
KV) runs a concurrent workload. A raw SUB per rank collects every FPM frame from an idle
heartbeat before the workload to the idle heartbeat after it. Then:

* every payload goes through `dynamo.common.forward_pass_metrics.decode` in the peers venv
  (`dynamo_fpm_decode.py`);
* Dynamo's own transport, `FpmEventRelay` (SUB on our PUB, to the event plane) and
  `FpmEventSubscriber` (as the planner reads it), delivers the same frames
  (`dynamo_fpm_relay.py`).

Synchronisation: the daemon sends an all-zero heartbeat after 1 s without a pass and every
second while idle, so a heartbeat received proves a subscription (or the relay chain) is live
with no slow-joiner loss after it, and the first heartbeat that follows the workload's pass
frames proves every pass's frame was sent. Waits have deadlines.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.wire.fpm_schema import ForwardPassMetrics, decode_fpm
from engined.wire.kv_events import read_seq
from tests.interop.peers import peer_env
from tests.server.daemon_harness import DaemonProcess, start_daemon

DECODE_HELPER = Path(__file__).with_name("dynamo_fpm_decode.py")
RELAY_HELPER = Path(__file__).with_name("dynamo_fpm_relay.py")
DP_SIZE = 2
WORKER_ID = "engined-interop"
SCENARIO_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 30.0
# Heartbeats come 1 s after the last message and every second after: a few intervals.
HEARTBEAT_TIMEOUT_S = 10.0
# The relay process also has to start Dynamo's runtime and discover its own publisher.
RELAY_LIVE_TIMEOUT_S = 30.0
DAEMON_FLAGS = (
    "--speedup-ratio",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "256",
    "--data-parallel-size",
    str(DP_SIZE),
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "64",
    "--worker-id",
    WORKER_ID,
)


@dataclass(frozen=True)
class Frame:
    rank: int
    seq: int
    payload: bytes

    @property
    def ours(self) -> ForwardPassMetrics:
        return decode_fpm(self.payload)


def is_heartbeat(m: ForwardPassMetrics) -> bool:
    return (
        m.wall_time == 0.0
        and m.scheduled_requests == type(m.scheduled_requests)()
        and m.queued_requests == type(m.queued_requests)()
    )


class FpmCollector:
    """A raw SUB per rank keeping every (seq, payload)."""

    def __init__(self, ctx: zmq.asyncio.Context, daemon: DaemonProcess) -> None:
        self.subs = []
        for rank in range(DP_SIZE):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(daemon.fpm_endpoint(rank))
            self.subs.append(sub)
        self.frames: list[list[Frame]] = [[] for _ in range(DP_SIZE)]

    def close(self) -> None:
        for sub in self.subs:
            sub.close()

    def all_frames(self) -> list[Frame]:
        return [frame for frames in self.frames for frame in frames]

    async def until_heartbeat(self, rank: int, *, after_pass: bool = False) -> Frame:
        """Read rank's frames up to and including the next idle heartbeat (with `after_pass`,
        the next one that follows a pass frame: older heartbeats may still be queued)."""
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S
        seen_pass = not after_pass
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"rank {rank}: no FPM heartbeat within the deadline")
            try:
                topic, seq, payload = await asyncio.wait_for(
                    self.subs[rank].recv_multipart(), remaining
                )
            except TimeoutError:
                continue
            assert topic == b"", topic
            frame = Frame(rank, read_seq(seq), payload)
            self.frames[rank].append(frame)
            if not is_heartbeat(frame.ours):
                seen_pass = True
            elif seen_pass:
                return frame


@asynccontextmanager
async def collector(daemon: DaemonProcess) -> AsyncIterator[FpmCollector]:
    ctx = zmq.asyncio.Context()
    frames = FpmCollector(ctx, daemon)
    try:
        yield frames
    finally:
        frames.close()
        ctx.term()


def prompts() -> list[tuple[list[int], int, int]]:
    """(tokens, max_tokens, dp_rank): shared prefixes, 20 to 220 tokens, 0 to 24 outputs."""
    out = []
    for i in range(16):
        prefix = [(i % 3) * 100_000 + t for t in range(48)]
        suffix = [1_000_000 + i * 1000 + t for t in range((i * 37) % 180)]
        out.append((prefix[: 20 + (i % 4) * 10] + suffix, (0, 1, 8, 24)[i % 4], i % DP_SIZE))
    return out


async def workload(daemon: DaemonProcess, frames: FpmCollector) -> list[Frame]:
    """Heartbeat on every rank, all requests at once, heartbeat on every rank again; returns
    each rank's closing heartbeat."""
    for rank in range(DP_SIZE):
        await frames.until_heartbeat(rank)
    async with await EngineClient.connect(daemon.control) as client:
        gens = await asyncio.gather(
            *(
                client.generate(tokens, n, dp_rank=rank, timeout=REQUEST_TIMEOUT_S)
                for tokens, n, rank in prompts()
            )
        )
    assert all(gen.finish_reason == "length" for gen in gens)
    # Every rank got requests, all submitted at once, so a rank runs passes without a break
    # until its last one: the first heartbeat after a pass frame follows all of them.
    return [await frames.until_heartbeat(rank, after_pass=True) for rank in range(DP_SIZE)]


def assert_ours(frames: list[Frame]) -> None:
    """Our own view: contiguous seqs per rank, counter_id == seq, our worker id and rank, and
    a workload that covers every part of the schema."""
    for rank in range(DP_SIZE):
        seqs = [f.seq for f in frames if f.rank == rank]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"rank {rank} lost frames"
    for f in frames:
        m = f.ours
        assert (m.version, m.dp_rank, m.worker_id, m.counter_id) == (1, f.rank, WORKER_ID, f.seq)
    metrics = [f.ours for f in frames]
    sched = [m.scheduled_requests for m in metrics]
    queued = [m.queued_requests for m in metrics]
    assert any(is_heartbeat(m) for m in metrics)
    assert any(m.wall_time > 0 for m in metrics)
    assert any(s.num_prefill_requests > 0 for s in sched)
    assert any(s.sum_prefill_kv_tokens > 0 for s in sched), "no prefill read cached KV"
    assert any(s.num_decode_requests > 1 and s.var_decode_kv_tokens > 0 for s in sched)
    assert any(q.num_prefill_requests > 0 and q.var_prefill_length > 0 for q in queued)


def dynamo_decode(python: Path, payloads: list[bytes]) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), str(DECODE_HELPER)],
        input=json.dumps([p.hex() for p in payloads]),
        capture_output=True,
        text=True,
        timeout=120,
        env=peer_env(),
    )
    assert proc.returncode == 0, proc.stderr
    # decode() logs a warning for every frame it refuses; none may be refused.
    assert "Failed to decode" not in proc.stderr and "Unsupported" not in proc.stderr, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_dynamo_decodes_every_fpm_frame(tmp_path: Path, peers_python: Path) -> None:
    """1. start engined (dp 2, max 2 running requests, 64-token passes, worker id set);
       subscribe to both FPM PUBs and wait for a heartbeat on each;
    2. run 16 requests, all submitted at once, spread over both ranks;
    3. read each rank up to its first heartbeat after the workload;
    4. decode every payload with Dynamo's decode() (peers venv) and with ours.

    Result: every frame decodes (non-None), version 1; Dynamo's fields equal ours field for
    field, and Dynamo's encode() of what it decoded gives our bytes back; dp_rank and
    worker_id are the rank's and ours; seqs are contiguous per rank and counter_id == seq;
    the frames cover prefill, chunked prefill with cached KV, decode, queued requests and
    heartbeats.
    """

    async def scenario(daemon: DaemonProcess) -> list[Frame]:
        async with collector(daemon) as frames:
            await workload(daemon, frames)
            return frames.all_frames()

    with start_daemon(tmp_path, *DAEMON_FLAGS) as daemon:
        frames = asyncio.run(asyncio.wait_for(scenario(daemon), SCENARIO_TIMEOUT_S))

    assert_ours(frames)
    decoded = dynamo_decode(peers_python, [f.payload for f in frames])
    assert decoded["fpm_version"] == 1
    assert len(decoded["results"]) == len(frames)
    for frame, result in zip(frames, decoded["results"], strict=True):
        where = f"rank {frame.rank} seq {frame.seq}"
        assert result["metrics"] is not None, f"{where}: Dynamo's decode() refused the frame"
        assert result["metrics"]["version"] == 1, where
        assert result["metrics"] == msgspec.to_builtins(frame.ours), where
        assert bytes.fromhex(result["reencoded"]) == frame.payload, where


class Relay:
    """`dynamo_fpm_relay.py` in the peers venv; `received` keeps what its subscriber got."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        # (dp_rank, counter_id) -> (raw payload, Dynamo's decode() as builtins or None)
        self.received: dict[tuple[int, int], tuple[bytes, Any]] = {}

    async def until(self, done: Any, timeout: float, what: str) -> None:
        """Read the relay's lines until `done(self)` holds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while not done(self):
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                line = await asyncio.wait_for(self.proc.stdout.readline(), remaining)
            except TimeoutError:
                raise AssertionError(
                    f"relay: {what} not within {timeout} s\n{self.log()}"
                ) from None
            if not line:
                raise AssertionError(f"relay exited: {self.proc.returncode}\n{self.log()}")
            message = json.loads(line)
            raw = bytes.fromhex(message["raw"])
            m = decode_fpm(raw)
            self.received[(m.dp_rank, m.counter_id)] = (raw, message["metrics"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@asynccontextmanager
async def relay(python: Path, daemon: DaemonProcess, tmp_path: Path) -> AsyncIterator[Relay]:
    log_path = tmp_path / "fpm-relay.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            str(python),
            str(RELAY_HELPER),
            *(daemon.fpm_endpoint(rank) for rank in range(DP_SIZE)),
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=peer_env(tmp_path),
        )
    try:
        yield Relay(proc, log_path)
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


def test_dynamo_relay_delivers_every_fpm_frame(tmp_path: Path, peers_python: Path) -> None:
    """1. start engined as in the decode test, a raw SUB per rank, and Dynamo's relay
       chain (FpmEventRelay per rank -> event plane -> FpmEventSubscriber, file discovery,
       all on the loopback); wait until a heartbeat of every rank came through the chain;
    2. run the same workload; read our SUBs up to each rank's closing heartbeat;
    3. read the relay's output until it delivered those closing heartbeats.

    Result: every frame our SUBs received from the first relayed heartbeat on came through
    Dynamo's chain with the same bytes, and Dynamo's decode() there gives our fields.
    """

    async def scenario(daemon: DaemonProcess) -> tuple[list[Frame], Relay, list[int]]:
        async with collector(daemon) as frames, relay(peers_python, daemon, tmp_path) as chain:

            def live(r: Relay) -> bool:
                ranks = {rank for rank, _ in r.received}
                return ranks == set(range(DP_SIZE))

            await chain.until(live, RELAY_LIVE_TIMEOUT_S, "a heartbeat of every rank")
            live_from = [min(c for r, c in chain.received if r == rank) for rank in range(DP_SIZE)]
            closing = await workload(daemon, frames)

            def caught_up(r: Relay) -> bool:
                return all((f.rank, f.seq) in r.received for f in closing)

            await chain.until(caught_up, HEARTBEAT_TIMEOUT_S, "the closing heartbeats")
            return frames.all_frames(), chain, live_from

    with start_daemon(tmp_path, *DAEMON_FLAGS) as daemon:
        frames, chain, live_from = asyncio.run(
            asyncio.wait_for(scenario(daemon), SCENARIO_TIMEOUT_S)
        )

    assert_ours(frames)
    complaints = [
        line for line in chain.log_path.read_text().splitlines() if '"level":"INFO"' not in line
    ]
    assert complaints == [], "the relay chain logged more than INFO"
    relayed = [f for f in frames if f.seq >= live_from[f.rank]]
    assert sum(not is_heartbeat(f.ours) for f in relayed) > 10
    for frame in relayed:
        where = f"rank {frame.rank} seq {frame.seq}"
        assert (frame.rank, frame.seq) in chain.received, f"{where}: never came through Dynamo"
        raw, metrics = chain.received[(frame.rank, frame.seq)]
        assert raw == frame.payload, where
        assert metrics is not None, f"{where}: Dynamo's decode() refused the relayed frame"
        assert metrics == msgspec.to_builtins(frame.ours), where
