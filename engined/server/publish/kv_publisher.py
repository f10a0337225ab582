"""KV-cache events of one data-parallel rank: a PUB socket in vLLM's frames, plus replay.

Frames and replay follow vLLM's `ZmqEventPublisher` (>= 0.26, the replay reply carries the
topic): `[topic, seq(8B BE), payload]` per engine pass that produced events; a ROUTER answers
`[identity, b"", start_seq]` with every buffered message from `start_seq` on, then the end
marker (engined.server.publish.kv_replay). Unlike vLLM there is no publisher thread and no queue:
`publish()` encodes and hands the message to libzmq without blocking, so the engine loop
never waits for a subscriber.

Slow subscribers cost bounded memory, and are dropped from, never waited for. libzmq bounds
a subscriber's queue in messages (SNDHWM), so the message bound is derived from a byte
budget: `buffer_bytes` divided by the largest batch a pass of this configuration can
produce (`max_batch_bytes`). A subscriber whose queue is full misses batches, as with
vLLM's publisher, until it has read half of it; it sees the seq gap and can replay. Each
such overflow is counted (`overflows`) and logged sparsely.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Final

import structlog
import zmq
import zmq.asyncio

from engined.core.args import EngineArgs
from engined.core.offload.config import DEFAULT_OFFLOAD_BATCH_SIZE
from engined.core.types import BlockRemoved, BlockStored, KvEvent, Medium
from engined.server.publish.kv_replay import STALL_TIMEOUT_S, ReplayBuffer, ReplayServer, Sleep
from engined.server.security.gatekeeper import Domain, Gatekeeper
from engined.wire.kv_events import KvEventEncoder, KvEventFormat, seq_bytes
from engined.zmq_sockets import SocketRegistry, bound_endpoint, overflow_aware_sender

log = structlog.get_logger()

DEFAULT_REPLAY_BUFFER: Final = 10_000
DEFAULT_BUFFER_BYTES: Final = 64 * 1024 * 1024
DEFAULT_REPLAY_CLIENT_BYTES: Final = 8 * 1024 * 1024
# What `max_batch_bytes` is assumed to be when the caller does not know the configuration.
DEFAULT_MAX_BATCH_BYTES: Final = 256 * 1024
# A replay request is three small frames; anything bigger is not one.
_REPLAY_MAX_MSG_SIZE: Final = 4096
# Replay requests queued in libzmq before the reader takes them (each is ~20 bytes).
_REPLAY_RCVHWM: Final = 1000
# A u32 token id in msgpack takes at most 5 bytes (uint32), a block hash 9 (uint64).
_MAX_TOKEN_ID: Final = 2**32 - 1
_MAX_HASH: Final = 2**64 - 1


def messages_within(budget_bytes: int, max_batch_bytes: int) -> int:
    """The high-water mark (messages) that keeps a queue within `budget_bytes`: at least 1."""
    return max(1, budget_bytes // max(1, max_batch_bytes))


def max_batch_bytes(args: EngineArgs, fmt: KvEventFormat, dp_rank: int = 0) -> int:
    """Bytes of the largest KV batch one pass of `args` is expected to produce, in `fmt`.

    A pass schedules at most `max_num_batched_tokens` new tokens over at most `max_num_seqs`
    requests, so it completes at most budget / block_size + max_num_seqs blocks (each request
    may finish one partial block; speculative drafts add theirs), and its allocations evict
    at most as many cached ones. With offload tiers, at most offload_batch_size² blocks are
    in flight to a tier, landing (and evicting there) in the same pass at worst. That worst
    case is encoded for real, one event per block (the most per-event overhead), with
    5-byte token ids and 9-byte hashes, and with MTP's lookahead token under vLLM semantics
    with prefix caching (`lookahead_token_ids`). Not covered: the removals a command causes (a
    destination reservation evicting for a whole prompt) ride on the next batch on top.
    """
    args = args.normalized()
    block_size = args.block_size
    pool = args.num_gpu_blocks
    seqs = min(args.max_num_seqs or pool, pool)
    budget = args.max_num_batched_tokens or pool * block_size
    drafts = seqs * math.ceil((args.aic_nextn or 0) / block_size)
    media = [(Medium.GPU, min(math.ceil(budget / block_size) + seqs + drafts, pool))]
    if args.num_g2_blocks is not None and args.kv_bytes_per_token is not None:
        in_flight = (args.offload_batch_size or DEFAULT_OFFLOAD_BATCH_SIZE) ** 2
        media.append((Medium.CPU, min(in_flight, pool)))
        if args.num_g3_blocks is not None:
            media.append((Medium.STORAGE, min(in_flight, args.num_g2_blocks)))
    one = [_MAX_HASH]
    tokens = [_MAX_TOKEN_ID] * block_size
    lookahead = (
        [[_MAX_TOKEN_ID]]
        if args.aic_nextn is not None and args.enable_prefix_caching and args.runs_vllm_semantics()
        else None
    )
    events: list[KvEvent] = []
    for medium, blocks in media:
        for n in range(blocks):
            events.append(
                BlockStored(
                    n,
                    dp_rank,
                    _MAX_HASH,
                    one,
                    one,
                    tokens,
                    block_size,
                    medium,
                    lookahead_token_ids=lookahead,
                )
            )
            events.append(BlockRemoved(n, dp_rank, one, medium))
    return len(KvEventEncoder(fmt).encode_batch(1.0e9, events, dp_rank))


class KvPublisher:
    """PUB socket (and optional replay ROUTER) of one rank.

    Invariants: seqs start at 0 and rise by 1 per published batch with no gaps, whether or
    not a subscriber got the message; the replay buffer holds the last `replay_buffer`
    messages, each payload encoded exactly once.

    Args:
        ctx: asyncio context shared by the daemon's sockets.
        registry: owns (and later closes) the sockets made here.
        endpoint: PUB endpoint of this rank (the caller has already offset the port).
        bind: bind the PUB (default deployment) or connect it to a central collector that
            binds a SUB.
        topic: frame 0 of every message (vLLM's `kv_events_topic`, default `""`).
        fmt: payload format, `"vllm"` or `"vllm-array"`.
        dp_rank: written into every batch as `data_parallel_rank`.
        replay_endpoint: where the replay ROUTER binds (always binds, like vLLM); None turns
            replay off and keeps no buffer.
        replay_buffer: how many messages replay can reach back.
        buffer_bytes: the most bytes of batches queued for one subscriber.
        replay_client_bytes: the most bytes of replay queued for one replay client.
        batch_bytes: the largest batch expected (`max_batch_bytes`); the two byte budgets
            become high-water marks in messages through it.
        hwm: an explicit PUB high-water mark in messages instead of the byte budget.
        replay_stall_timeout_s: a replay that could send nothing for this long is abandoned.
        clock, sleep: the replay server's time (stall timeout, retry backoff).
        gate: the process's ZAP handler, which admits (and counts) every peer of the
            sockets bound here; None admits every peer unasked (tests).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        *,
        endpoint: str,
        bind: bool,
        topic: str,
        fmt: KvEventFormat,
        dp_rank: int,
        replay_endpoint: str | None,
        replay_buffer: int = DEFAULT_REPLAY_BUFFER,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        replay_client_bytes: int = DEFAULT_REPLAY_CLIENT_BYTES,
        batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        hwm: int | None = None,
        replay_stall_timeout_s: float = STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        gate: Gatekeeper | None = None,
    ) -> None:
        if replay_buffer < 0:
            raise ValueError(f"replay_buffer must be >= 0, got {replay_buffer}")
        self._encoder = KvEventEncoder(fmt)
        self._topic = topic.encode("utf-8")
        self._dp_rank = dp_rank
        self._next_seq = 0
        self._overflows = 0
        self._log = log.bind(dp_rank=dp_rank)
        # NOTE: with replay off nothing can read the buffer, so it keeps nothing.
        self._buffer = ReplayBuffer(replay_buffer if replay_endpoint is not None else 0)
        self.hwm = hwm if hwm is not None else messages_within(buffer_bytes, batch_bytes)
        pub_security = gate.options(Domain.PUBLISH) if gate is not None and bind else {}
        self._pub = registry.make(
            ctx, zmq.PUB, endpoint, bind=bind, sndhwm=self.hwm, rcvhwm=self.hwm, **pub_security
        )
        self._send = overflow_aware_sender(self._pub)
        self.endpoint = bound_endpoint(self._pub, endpoint) if bind else endpoint

        self._replay: ReplayServer | None = None
        self.replay_endpoint: str | None = None
        self.replay_hwm = messages_within(replay_client_bytes, batch_bytes)
        if replay_endpoint is not None:
            # ROUTER_MANDATORY: a full client queue (it stopped reading) or a vanished client
            # is an error the replay server sees, not a silent loss.
            sock = registry.make(
                ctx,
                zmq.ROUTER,
                replay_endpoint,
                bind=True,
                sndhwm=self.replay_hwm,
                rcvhwm=_REPLAY_RCVHWM,
                maxmsgsize=_REPLAY_MAX_MSG_SIZE,
                router_mandatory=True,
                **(gate.options(Domain.REPLAY) if gate is not None else {}),
            )
            self.replay_endpoint = bound_endpoint(sock, replay_endpoint)
            self._replay = ReplayServer(
                sock,
                self._buffer,
                topic=self._topic,
                dp_rank=dp_rank,
                stall_timeout_s=replay_stall_timeout_s,
                clock=clock,
                sleep=sleep,
            )
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will carry (= batches published so far)."""
        return self._next_seq

    @property
    def overflows(self) -> int:
        """Times a subscriber's queue was full: it missed batches until it read half of it."""
        return self._overflows

    @property
    def replay(self) -> ReplayServer | None:
        return self._replay

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        """Background tasks, for the daemon to supervise (a failure must end the process)."""
        return () if self._replay_task is None else (self._replay_task,)

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        """Publish one engine pass's events as one batch; never blocks.

        An empty pass publishes nothing and consumes no seq (vLLM sends no empty batches).

        Args:
            events: the core's KV events of the pass, in order.
            ts: wall-clock seconds stamped into the batch (vLLM uses `time.time()`).
        """
        if not events:
            return
        payload = self._encoder.encode_batch(ts, events, self._dp_rank)
        seq = self._next_seq
        self._next_seq = seq + 1
        # Buffered before sending: a batch a subscriber misses is still recoverable by replay.
        self._buffer.append(seq, payload)
        if not self._send((self._topic, seq_bytes(seq), payload)):
            self._overflows += 1
            # NOTE: one line per power of two, so a subscriber that keeps falling behind
            # cannot flood the log.
            if self._overflows & (self._overflows - 1) == 0:
                self._log.warning(
                    "kv event subscriber fell behind; it misses batches until it catches up",
                    seq=seq,
                    overflows=self._overflows,
                    hwm=self.hwm,
                )

    def start(self) -> None:
        """Launch the replay server (when replay is on); needs a running event loop."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(
                self._replay.serve(), name=f"kv-replay-{self._dp_rank}"
            )
            self._replay_task.add_done_callback(_log_task_failure)

    async def close(self) -> None:
        """Stop the replay task; the registry closes the sockets afterwards.

        Raises whatever the replay task failed with, so a broken task cannot go unnoticed.
        """
        task, self._replay_task = self._replay_task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("background task failed", task=task.get_name(), exc_info=exc)


class NullKvPublisher:
    """The publisher when KV events are off (`kv_events_endpoint = ""`): same interface, no
    socket, and a pass's events are dropped without being encoded."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    replay: ReplayServer | None = None
    overflows = 0
    # No queue of either kind, which the start-up log's limits report as 0.
    hwm = 0
    replay_hwm = 0

    @property
    def next_seq(self) -> int:
        return 0

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        return ()

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        pass

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


AnyKvPublisher = KvPublisher | NullKvPublisher
