"""Run a real `engined serve` process and watch what it publishes.

`start_daemon()` starts the daemon on ipc:// endpoints under a test's tmp_path and returns
once it answers `hello`; `KvStream` subscribes to a rank's KV PUB socket and recovers every
batch it missed through the replay socket (as vLLM consumers do), so a test sees the whole
stream, in order, whatever the slow-joiner timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engined.client import EngineClient
from engined.core import types as core
from engined.core.types import KvEvent
from engined.wire.fpm_schema import ForwardPassMetrics, decode_fpm
from engined.wire.kv_events import (
    REPLAY_END_SEQ,
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    ExternalBlockHash,
    decode_batch,
    read_seq,
    seq_bytes,
)
from engined.zmq_sockets import CurveClientKeys
from tests.reference_indexer import ReferenceIndexer

# A daemon paced on the fixed model, a pass every 10 ms of wall time: a request with a long
# answer stays in flight, one token a pass, while a test looks. Modules add what else they need.
PACED_FLAGS = ("--speedup-ratio", "1", "--perf-model", "fixed", "--fixed-decode-ms-per-pass", "10")

ENGINED = [sys.executable, "-m", "engined.cli"]


class DaemonProcess:
    def __init__(
        self,
        tmp_path: Path,
        args: list[str],
        env: dict[str, str] | None,
        control: str | None = None,
        ready_keys: CurveClientKeys | None = None,
    ) -> None:
        self.ready_keys = ready_keys
        base = tmp_path / "engined"
        self.control = control or f"ipc://{base}-control"
        self.kv = f"ipc://{base}-kv"
        self.replay = f"ipc://{base}-replay"
        self.fpm = f"ipc://{base}-fpm"
        command = [
            *ENGINED,
            "serve",
            "--control-endpoint",
            self.control,
            "--kv-events-endpoint",
            self.kv,
            "--kv-replay-endpoint",
            self.replay,
            "--fpm-endpoint",
            self.fpm,
            "--log-format",
            "json",
            *args,
        ]
        self.log_path = tmp_path / "engined.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @staticmethod
    def rank_endpoint(endpoint: str, rank: int) -> str:
        return endpoint if rank == 0 else f"{endpoint}-{rank}"

    def kv_endpoint(self, rank: int = 0) -> str:
        return self.rank_endpoint(self.kv, rank)

    def replay_endpoint(self, rank: int = 0) -> str:
        return self.rank_endpoint(self.replay, rank)

    def fpm_endpoint(self, rank: int = 0) -> str:
        return self.rank_endpoint(self.fpm, rank)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Ping until the daemon answers, from one client: the pongs of pings that timed out
        while it started still reach a live socket (in order, before the last one), so the
        probe leaves no reply to a vanished client, which the daemon would log as gone."""

        async def probe() -> None:
            deadline = time.monotonic() + timeout
            async with await EngineClient.connect(self.control, curve=self.ready_keys) as client:
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        raise AssertionError(
                            f"engined exited with {self.proc.returncode}:\n{self.log()}"
                        )
                    try:
                        await client.ping(timeout=0.5)
                        return
                    except TimeoutError:
                        continue
            raise AssertionError(f"engined did not answer within {timeout} s:\n{self.log()}")

        asyncio.run(probe())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


@contextmanager
def start_daemon(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    expect_exit: int | None = 0,
    control: str | None = None,
    ready_keys: CurveClientKeys | None = None,
) -> Iterator[DaemonProcess]:
    """A running daemon; on exit it gets SIGTERM and must exit with `expect_exit`.

    `control` replaces the ipc control endpoint (a tcp one, say); `ready_keys` are the
    CURVE keys to ask it whether it is ready with."""
    daemon = DaemonProcess(tmp_path, list(args), env, control, ready_keys)
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        code = daemon.stop()
        if expect_exit is not None:
            assert code == expect_exit, f"engined exited with {code}:\n{daemon.log()}"


def free_tcp_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def start_tcp_daemon(tmp_path: Path, *args: str) -> Iterator[DaemonProcess]:
    """`start_daemon` with its control socket on loopback tcp, whose peers are clients, and
    its operator endpoint in a private directory under `tmp_path`."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with start_daemon(
        tmp_path,
        *args,
        env={"XDG_RUNTIME_DIR": str(run)},
        control=f"tcp://127.0.0.1:{free_tcp_port()}",
    ) as daemon:
        yield daemon


class KvStream:
    """All KV batches of one rank, in seq order, gaps filled from the replay socket."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str) -> None:
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._replay = ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self.next_seq = 0
        self.batches: list[DecodedBatch] = []
        self.replayed = 0

    def close(self) -> None:
        self._sub.close()
        self._replay.close()

    async def _replay_from(self, start: int) -> None:
        await self._replay.send_multipart([b"", seq_bytes(start)])
        while True:
            frames = await asyncio.wait_for(self._replay.recv_multipart(), 10)
            _, _topic, seq_frame, payload = frames
            if seq_frame == REPLAY_END_SEQ:
                return
            seq = read_seq(seq_frame)
            if seq == self.next_seq:
                self.batches.append(decode_batch(payload))
                self.next_seq += 1
                self.replayed += 1

    async def catch_up(self, timeout: float = 0.05) -> None:
        """Take what the PUB socket delivered, then ask the replay socket for the rest."""
        while await self._sub.poll(timeout * 1000):
            _topic, seq_frame, payload = await self._sub.recv_multipart()
            seq = read_seq(seq_frame)
            if seq > self.next_seq:
                await self._replay_from(self.next_seq)
            if seq == self.next_seq:
                self.batches.append(decode_batch(payload))
                self.next_seq += 1
        await self._replay_from(self.next_seq)

    def events(self) -> list[object]:
        return [event for batch in self.batches for event in batch.events]


async def published_stores(daemon: DaemonProcess) -> list[BlockStored]:
    """Every BlockStored rank 0 of `daemon` has published so far, in order (the replay
    socket fills what the subscription missed)."""
    ctx = zmq.asyncio.Context()
    stream = KvStream(ctx, daemon.kv_endpoint(), daemon.replay_endpoint())
    try:
        await stream.catch_up()
        return [e for e in stream.events() if isinstance(e, BlockStored)]
    finally:
        stream.close()
        ctx.term()


async def expect_refusals(endpoint: str, cases: Sequence[tuple[dict[str, object], str]]) -> None:
    """Send each raw message (its `id` set to its index) and check the `error` reply's code;
    a message is at most 512 characters, whatever the input."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        for n, (body, code) in enumerate(cases):
            await sock.send(msgspec.msgpack.encode({**body, "id": n}))
            reply = msgspec.msgpack.decode(await sock.recv())
            assert (reply["type"], reply["code"], reply["id"]) == ("error", code, n), reply
            assert len(reply["message"]) <= 512
    finally:
        sock.close(0)
        ctx.term()


async def read_fpm(
    ctx: zmq.asyncio.Context, endpoint: str, count: int, timeout: float = 10.0
) -> list[ForwardPassMetrics]:
    """The next `count` FPM messages from a rank (frames [b"", seq, payload])."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        out: list[ForwardPassMetrics] = []
        while len(out) < count:
            _topic, _seq, payload = await asyncio.wait_for(sub.recv_multipart(), timeout)
            out.append(decode_fpm(payload))
        return out
    finally:
        sub.close()


def to_core_events(batches: list[DecodedBatch]) -> list[KvEvent]:
    """Wire events as core events for the reference indexer.

    The vLLM format has no event ids and no per-block content hashes: ids are numbered in
    stream order, and local hashes are computed from the blocks' token ids, so the indexer's
    chain check verifies the wire hashes against the tokens the wire carries.
    """
    from tests.reference_indexer import local_block_hash

    out: list[KvEvent] = []
    for batch in batches:
        rank = batch.data_parallel_rank or 0
        for event in batch.events:
            if isinstance(event, BlockStored | ArrayBlockStored):
                bs = event.block_size
                tokens = list(event.token_ids)
                local = [local_block_hash(tokens[i : i + bs]) for i in range(0, len(tokens), bs)]
                parent = None if event.parent_block_hash is None else _hash(event.parent_block_hash)
                out.append(
                    core.BlockStored(
                        len(out),
                        rank,
                        parent,
                        [_hash(h) for h in event.block_hashes],
                        local,
                        tokens,
                        bs,
                        core.Medium(event.medium or "GPU"),
                        lookahead_token_ids=event.lookahead_token_ids
                        if isinstance(event, BlockStored)
                        else None,
                    )
                )
            elif isinstance(event, BlockRemoved | ArrayBlockRemoved):
                hashes = [_hash(h) for h in event.block_hashes]
                out.append(
                    core.BlockRemoved(len(out), rank, hashes, core.Medium(event.medium or "GPU"))
                )
            else:
                out.append(core.AllBlocksCleared(len(out), rank))
    return out


def _hash(block_hash: ExternalBlockHash) -> int:
    """engined publishes block hashes as integers (vLLM may send bytes; engined never does)."""
    assert isinstance(block_hash, int), block_hash
    return block_hash


def assert_each_prompt_on_its_rank(
    indexer: ReferenceIndexer, placed: list[tuple[list[int], int]], block_size: int
) -> None:
    """Of two ranks, each prompt's full blocks are all on the rank it was served by and none
    on the other, as a KV-aware router reading both ranks' events would see them."""
    for tokens, rank in placed:
        full = len(tokens) // block_size
        assert indexer.overlap(tokens, dp_rank=rank) == full
        assert indexer.overlap(tokens, dp_rank=1 - rank) == 0
