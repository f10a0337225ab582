"""KV-cache events of one data-parallel rank: a PUB socket in vLLM's frames, plus replay.

Frames and replay follow vLLM's `ZmqEventPublisher` (>= 0.26, the replay reply carries the
topic): `[topic, seq(8B BE), payload]` per engine pass that produced events; a ROUTER answers
`[identity, b"", start_seq]` with every buffered message from `start_seq` on, then the end
marker. Unlike vLLM there is no publisher thread and no queue: `publish()` encodes and hands
the message to libzmq without blocking, so the engine loop never waits for a subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol

import structlog
import zmq
import zmq.asyncio

from engined.core.types import KvEvent
from engined.server.sockets import SocketRegistry, bound_endpoint, nonblocking_sender
from engined.wire.errors import WireError
from engined.wire.kv_events import (
    REPLAY_END_FRAMES,
    KvEventEncoder,
    KvEventFormat,
    read_seq,
    seq_bytes,
)

log = structlog.get_logger()

# vLLM's `KVEventsConfig.hwm`: a subscriber may lag this many batches before it loses some.
DEFAULT_PUB_HWM: Final = 100_000
DEFAULT_REPLAY_BUFFER: Final = 10_000
# A replay request is three small frames; anything bigger is not one.
_REPLAY_MAX_MSG_SIZE: Final = 4096


class KvEventSink(Protocol):
    """What the engine loop needs from a KV event publisher (real or null)."""

    def publish(self, events: Sequence[KvEvent], ts: float) -> None: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]: ...


class KvPublisher:
    """PUB socket (and optional replay ROUTER) of one rank.

    Invariants: seqs start at 0 and rise by 1 per published batch with no gaps, whether or
    not libzmq delivered the message; the replay buffer holds the last `replay_buffer`
    messages as `(seq, payload)`, each payload encoded exactly once.

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
        hwm: PUB send high-water mark per subscriber; beyond it libzmq drops messages for
            that subscriber (it sees a seq gap and can replay).
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
        hwm: int = DEFAULT_PUB_HWM,
    ) -> None:
        if replay_buffer < 0:
            raise ValueError(f"replay_buffer must be >= 0, got {replay_buffer}")
        self._encoder = KvEventEncoder(fmt)
        self._topic = topic.encode("utf-8")
        self._dp_rank = dp_rank
        self._next_seq = 0
        self._dropped = 0
        self._dropping = False  # inside a run of refused sends (logged once per run)
        self._log = log.bind(dp_rank=dp_rank)
        # NOTE: with replay off nothing can read the buffer, so it keeps nothing (maxlen 0
        # makes append a no-op: no branch on the hot path).
        self._buffer: deque[tuple[int, bytes]] = deque(
            maxlen=replay_buffer if replay_endpoint is not None else 0
        )

        self._pub = registry.make(ctx, zmq.PUB, endpoint, bind=bind, sndhwm=hwm, rcvhwm=hwm)
        self._send = nonblocking_sender(self._pub)
        self.endpoint = bound_endpoint(self._pub, endpoint) if bind else endpoint

        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            # NOTE: SNDHWM fits two complete replays (vLLM >= 0.33 uses the same bound), so a
            # reply never hits the HWM unless its client stopped reading; ROUTER_MANDATORY
            # then makes that (and a vanished client) an error we log instead of a silent loss.
            self._replay = registry.make(
                ctx,
                zmq.ROUTER,
                replay_endpoint,
                bind=True,
                sndhwm=2 * (replay_buffer + 1),
                rcvhwm=DEFAULT_PUB_HWM,
                maxmsgsize=_REPLAY_MAX_MSG_SIZE,
                router_mandatory=True,
            )
            self.replay_endpoint = bound_endpoint(self._replay, replay_endpoint)
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will carry (= batches published so far)."""
        return self._next_seq

    @property
    def dropped(self) -> int:
        """Batches libzmq refused (EAGAIN) and that only replay can still deliver."""
        return self._dropped

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
        # Buffered before sending: a batch libzmq refuses is still recoverable by replay.
        self._buffer.append((seq, payload))
        if not self._send((self._topic, seq_bytes(seq), payload)):
            # NOTE: libzmq's PUB drops silently per subscriber at its HWM, so EAGAIN is rare;
            # log once per run of refusals, never per message.
            if not self._dropping:
                self._log.warning("kv event batch dropped", seq=seq)
            self._dropped += 1
            self._dropping = True
        else:
            self._dropping = False

    def start(self) -> None:
        """Launch the replay server (when replay is on); needs a running event loop."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(
                self.serve_replay(), name=f"kv-replay-{self._dp_rank}"
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

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled.

        A malformed request gets just the end marker (the client stops waiting at once) and
        a warning; a client that vanished or stopped reading loses the rest of its reply.
        Neither ends the task.
        """
        sock = self._replay
        if sock is None:
            raise RuntimeError("replay is disabled for this publisher")
        while True:
            frames: list[bytes] = await sock.recv_multipart()
            try:
                await self._answer(sock, frames)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the client is gone; EAGAIN: its queue is full (it stopped
                # reading). Either way only that reply is affected.
                self._log.warning(
                    "kv replay reply abandoned",
                    identity=frames[0].hex() if frames else "",
                    error=str(exc),
                )

    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        identity = frames[0]
        start = _parse_replay_request(frames)
        if start is None:
            self._log.warning(
                "malformed kv replay request",
                identity=identity.hex(),
                frames=len(frames),
                sizes=[len(f) for f in frames[1:]],
            )
        else:
            # Snapshot the part to send: publish() may append while a send yields.
            buffer = self._buffer
            # Seqs in the buffer are contiguous, so `start` maps to an index; clamp it, since
            # a client may ask for any u64.
            skip = min(max(0, start - buffer[0][0]), len(buffer)) if buffer else 0
            for seq, payload in list(itertools.islice(buffer, skip, None)):
                await sock.send_multipart(
                    (identity, b"", self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK
                )
        await sock.send_multipart((identity, b"", *REPLAY_END_FRAMES), flags=zmq.NOBLOCK)


def _parse_replay_request(frames: list[bytes]) -> int | None:
    """The start seq of `[identity, b"", start_seq(8 bytes)]`, None when malformed."""
    if len(frames) != 3 or frames[1] != b"":
        return None
    try:
        return read_seq(frames[2])
    except WireError:
        return None


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("background task failed", task=task.get_name(), exc_info=exc)


class NullKvPublisher:
    """The publisher when KV events are off: same interface, does nothing."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

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
