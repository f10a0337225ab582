"""KV event replay (vLLM >= 0.26): a ROUTER answers `[identity, b"", start_seq]` with every
buffered batch from `start_seq` on, then the end marker, streamed with bounded memory.

What a client costs the daemon is bounded whatever it does:

* in flight: libzmq queues at most `SNDHWM` messages per client, and SNDHWM is derived from
  `client_bytes` and the largest batch a pass can produce, so a client that stops reading
  holds at most `client_bytes` of replies in the daemon (until it disconnects);
* a replay is a cursor into the buffer, not a copy of it: batches are read from the buffer
  as they are sent, and one evicted meanwhile is skipped (the client sees a seq gap, as when
  it asks for an evicted start);
* a replay that makes no progress for `stall_timeout_s` is abandoned (logged);
* at most MAX_STREAMS replays stream at once, a client's further requests queue behind its
  own replay (MAX_QUEUED_PER_CLIENT), other clients' behind the streams (MAX_WAITING); a
  request beyond those is dropped and logged, and its client times out as it would with a
  lost reply;
* every turn of the event loop sends at most TURN_MESSAGES messages per stream, so a
  replay of the whole buffer never holds up passes or the control socket.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import structlog
import zmq
import zmq.asyncio

from engined.wire.kv_events import REPLAY_END_FRAMES, read_seq, seq_bytes
from engined.wire.protocol_errors import WireError

log = structlog.get_logger()

MAX_STREAMS: Final = 32
MAX_QUEUED_PER_CLIENT: Final = 4
MAX_WAITING: Final = 1024
TURN_MESSAGES: Final = 64
# No message accepted for this long: the client stopped reading and its replay is abandoned.
STALL_TIMEOUT_S: Final = 10.0
# Backoff between send attempts to a client whose queue is full.
_RETRY_FIRST_S: Final = 0.001
_RETRY_MAX_S: Final = 0.05

Sleep = Callable[[float], Awaitable[None]]


class ReplayBuffer:
    """The last `capacity` batches as `(seq, payload)`, in a ring: O(1) append and lookup.

    Seqs are contiguous (the publisher numbers every batch), so a seq maps to a slot.
    """

    __slots__ = ("_capacity", "_next", "_slots")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"replay buffer capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._slots: list[bytes | None] = [None] * capacity
        self._next = 0  # seq of the next batch

    def __len__(self) -> int:
        return min(self._next, self._capacity)

    @property
    def oldest(self) -> int:
        """The oldest buffered seq (== `next_seq` when empty)."""
        return self._next - len(self)

    @property
    def next_seq(self) -> int:
        return self._next

    def append(self, seq: int, payload: bytes) -> None:
        if seq != self._next:
            raise ValueError(f"replay buffer expects seq {self._next}, got {seq}")
        self._next = seq + 1
        if self._capacity:
            self._slots[seq % self._capacity] = payload

    def get(self, seq: int) -> bytes | None:
        """The payload of `seq`, or None when it is not (or no longer) buffered."""
        if not self.oldest <= seq < self._next:
            return None
        return self._slots[seq % self._capacity]


@dataclass(slots=True)
class _Replay:
    identity: bytes
    # Requests of this client, oldest first: (first seq, seq after the last one to send).
    requests: deque[tuple[int, int]] = field(default_factory=deque)


class ReplayServer:
    """Serves replay requests on `sock` (a ROUTER with ROUTER_MANDATORY) from `buffer`.

    Args:
        clock, sleep: seconds and a way to wait for them (the stall timeout and the retry
            backoff); tests pass a virtual clock.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        buffer: ReplayBuffer,
        *,
        topic: bytes,
        dp_rank: int,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._sock = sock
        self._send_sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._buffer = buffer
        self._topic = topic
        self._stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._sleep = sleep
        self._log = log.bind(dp_rank=dp_rank)
        self._streams: dict[bytes, _Replay] = {}
        self._waiting: deque[_Replay] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self.abandoned = 0  # replays given up because their client stopped reading
        self.refused = 0  # requests dropped because every queue was full

    @property
    def streaming(self) -> int:
        return len(self._streams)

    async def serve(self) -> None:
        """Read requests until cancelled; streams run as tasks of their own."""
        sock = self._sock
        try:
            while True:
                for _ in range(TURN_MESSAGES):
                    self._request(await sock.recv_multipart())
                await asyncio.sleep(0)
        finally:
            self._waiting.clear()  # a stream that ends must not start another now
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    def _request(self, frames: list[bytes]) -> None:
        identity = frames[0]
        start = _parse_request(frames)
        if start is None:
            self._log.warning(
                "malformed kv replay request",
                identity=identity.hex(),
                frames=len(frames),
                sizes=[len(f) for f in frames[1:]],
            )
            self._try_send((identity, b"", *REPLAY_END_FRAMES))
            return
        request = (start, self._buffer.next_seq)
        replay = self._streams.get(identity) or next(
            (r for r in self._waiting if r.identity == identity), None
        )
        if replay is not None:
            if len(replay.requests) >= MAX_QUEUED_PER_CLIENT:
                self._refuse(identity, "too many replay requests from one client")
            else:
                replay.requests.append(request)
            return
        replay = _Replay(identity, deque([request]))
        if len(self._streams) < MAX_STREAMS:
            self._start(replay)
        elif len(self._waiting) < MAX_WAITING:
            self._waiting.append(replay)
        else:
            self._refuse(identity, "too many replay clients waiting")

    def _refuse(self, identity: bytes, why: str) -> None:
        self.refused += 1
        # NOTE: one line per power of two, so a flood of requests cannot flood the log.
        if self.refused & (self.refused - 1) == 0:
            self._log.warning(
                "kv replay request dropped", identity=identity.hex(), reason=why, total=self.refused
            )

    def _start(self, replay: _Replay) -> None:
        self._streams[replay.identity] = replay
        task = asyncio.get_running_loop().create_task(self._stream(replay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, replay: _Replay) -> None:
        try:
            while replay.requests:
                start, end = replay.requests[0]
                if not await self._send_range(replay.identity, start, end):
                    break
                replay.requests.popleft()
        finally:
            del self._streams[replay.identity]
            if self._waiting:
                self._start(self._waiting.popleft())

    async def _send_range(self, identity: bytes, start: int, end: int) -> bool:
        """Send seqs [start, end) still buffered, then the end marker; False if abandoned."""
        buffer = self._buffer
        seq = start
        sent_this_turn = 0
        while True:
            # Clamp to what is buffered now: a client may ask for any u64, and batches may
            # be evicted while a slow client reads.
            seq = max(seq, buffer.oldest)
            payload = buffer.get(seq) if seq < end else None
            frames = (
                (identity, b"", self._topic, seq_bytes(seq), payload)
                if payload is not None
                else (identity, b"", *REPLAY_END_FRAMES)
            )
            if not await self._send_when_room(frames):
                return False
            if payload is None:
                return True
            seq += 1
            sent_this_turn += 1
            if sent_this_turn == TURN_MESSAGES:
                sent_this_turn = 0
                await asyncio.sleep(0)

    async def _send_when_room(self, frames: tuple[bytes, ...]) -> bool:
        """Send once the client's queue has room; False when it is gone or stalled."""
        delay = _RETRY_FIRST_S
        stalled_since: float | None = None
        while True:
            outcome = self._try_send(frames)
            if outcome is not None:
                return outcome
            now = self._clock()
            if stalled_since is None:
                stalled_since = now
            elif now - stalled_since >= self._stall_timeout_s:
                self.abandoned += 1
                self._log.warning(
                    "kv replay abandoned: the client stopped reading",
                    identity=frames[0].hex(),
                    stalled_s=round(now - stalled_since, 3),
                )
                return False
            await self._sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    def _try_send(self, frames: tuple[bytes, ...]) -> bool | None:
        """True sent, False the client is gone, None its queue is full (try again)."""
        try:
            self._send_sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            return False
        finally:
            # NOTE: a send through the shadow may consume the edge of the ZMQ FD that
            # announces incoming requests; reading EVENTS reschedules serve()'s recv (as
            # engined.server.control.control_server does after its sends).
            self._sock.get(zmq.EVENTS)
        return True


def _parse_request(frames: list[bytes]) -> int | None:
    """The start seq of `[identity, b"", start_seq(8 bytes)]`, None when malformed."""
    if len(frames) != 3 or frames[1] != b"":
        return None
    try:
        return read_seq(frames[2])
    except WireError:
        return None
