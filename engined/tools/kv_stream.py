"""Reading one rank's KV event stream the way vLLM's consumers read it: in seq order, gaps
recovered from replay, replayed batches not shown twice, a publisher restart noticed.

Apart from `engined.tools.events` (the command: endpoints and rendering) because these rules
are what a router's listener must get right, and read best without the printing. The SUB
socket is connected before replay is asked for, so batches published while the replay is read
wait in its queue instead of being lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import zmq
import zmq.asyncio

from engined.tools.common import ToolError
from engined.wire.kv_events import (
    REPLAY_END_SEQ,
    read_seq,
    seq_bytes,
)
from engined.wire.protocol_errors import WireError
from engined.zmq_sockets import make_socket

# A subscriber that falls this far behind loses batches (as vLLM's consumers configure it).
_SUB_HWM: Final = 100_000


@dataclass(frozen=True, slots=True)
class Message:
    """One KV message `[topic, seq, payload]`, live or from the replay socket."""

    seq: int
    topic: bytes
    payload: bytes
    replayed: bool


@dataclass(frozen=True, slots=True)
class Gap:
    """Seqs `expected .. got - 1` were not received where they should have been.

    `source` is `live` for a hole in the PUB stream, `replay` when the replay buffer no longer
    held them (evicted), which nothing can recover.
    """

    expected: int
    got: int
    source: Literal["live", "replay"]


@dataclass(frozen=True, slots=True)
class Recovery:
    """The outcome of filling a live gap from the replay socket."""

    expected: int
    got: int
    batches: int
    missing: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Restart:
    """The live seq went backwards: the publisher restarted and counts from its start again."""

    previous: int
    got: int


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message that is not `[topic, 8-byte seq, payload]`."""

    frames: int
    reason: str


StreamItem: TypeAlias = Message | Gap | Recovery | Restart | Malformed


class KvStreamReader:
    """The KV messages of one rank in seq order: replay first, then live, gaps refilled.

    Args:
        ctx: the context owning the sockets.
        events_endpoint: the rank's KV PUB.
        replay_endpoint: its replay ROUTER, or None (no history, gaps stay gaps).
        timeout: seconds to wait for each frame of a replay reply.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        events_endpoint: str,
        replay_endpoint: str | None,
        timeout: float,
    ) -> None:
        self._ctx = ctx
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self._timeout = timeout
        self._sub = make_socket(
            ctx, zmq.SUB, events_endpoint, bind=False, rcvhwm=_SUB_HWM, linger=0
        )
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._replay: zmq.asyncio.Socket | None = None

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    async def replay(self, start: int) -> AsyncIterator[tuple[int, bytes, bytes]]:
        """`(seq, topic, payload)` of every buffered message from `start` on.

        Raises:
            TimeoutError: a reply frame did not come within the timeout; the socket is
                replaced so a late reply cannot be taken for the next one.
        """
        assert self.replay_endpoint is not None
        if self._replay is None:
            self._replay = make_socket(
                self._ctx, zmq.DEALER, self.replay_endpoint, bind=False, rcvhwm=0, linger=0
            )
        sock = self._replay
        try:
            await sock.send_multipart([b"", seq_bytes(start)])
            while True:
                async with asyncio.timeout(self._timeout):
                    frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    continue
                _, topic, seq_frame, payload = frames
                # The end marker: empty payload (and seq 2**64 - 1).
                if not payload or seq_frame == REPLAY_END_SEQ:
                    return
                try:
                    seq = read_seq(seq_frame)
                except WireError:
                    continue
                yield seq, topic, payload
        except BaseException:
            sock.close(linger=0)
            self._replay = None
            raise

    async def stream(
        self, replay_from: int | None, follow: bool
    ) -> AsyncGenerator[StreamItem, None]:
        """Everything to show, in order; see the module docstring for the rules."""
        expected = replay_from
        if replay_from is not None and self.replay_endpoint is not None:
            try:
                async for seq, topic, payload in self.replay(replay_from):
                    assert expected is not None
                    if seq < expected:
                        continue
                    if seq > expected:
                        yield Gap(expected, seq, "replay")
                    yield Message(seq, topic, payload, replayed=True)
                    expected = seq + 1
            except TimeoutError:
                raise ToolError(
                    f"the replay endpoint {self.replay_endpoint} did not answer within "
                    f"{self._timeout:g} s"
                ) from None
        if not follow:
            return
        last_live: int | None = None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                yield Malformed(len(frames), "expected [topic, 8-byte seq, payload]")
                continue
            topic, seq_frame, payload = frames
            seq = int.from_bytes(seq_frame, "big")
            if last_live is not None and seq <= last_live:
                yield Restart(last_live, seq)
                expected = seq
            last_live = seq
            if expected is not None and seq < expected:
                continue  # already shown through replay
            if expected is not None and seq > expected:
                yield Gap(expected, seq, "live")
                if self.replay_endpoint is not None:
                    recovery: list[Message] = []
                    error: str | None = None
                    try:
                        async for rseq, rtopic, rpayload in self.replay(expected):
                            if expected + len(recovery) <= rseq < seq:
                                recovery.append(Message(rseq, rtopic, rpayload, replayed=True))
                    except TimeoutError:
                        error = (
                            f"the replay endpoint {self.replay_endpoint} did not answer within "
                            f"{self._timeout:g} s"
                        )
                    for message in recovery:
                        yield message
                    missing = seq - expected - len(recovery)
                    yield Recovery(expected, seq, len(recovery), missing, error)
            yield Message(seq, topic, payload, replayed=False)
            expected = seq + 1
