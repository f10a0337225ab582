"""Reading the control ROUTER in bounded turns, and what is still queued at shutdown.

Apart from the control server, which decides what messages mean: this reads envelopes and
bodies, answers malformed ones (logged in bursts per client), and hands each decoded message
on, yielding to the event loop between turns so that the passes, publishers, signals and
watchdog pings on the same loop are never held by a burst.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
import zmq
import zmq.asyncio

from engined.server.control.clients import DELIMITER, ClientTable
from engined.server.control.log_throttle import LogThrottle
from engined.server.ranks.deadlines import Deadlines
from engined.wire import control as wire
from engined.wire.protocol_errors import WireError

log = structlog.get_logger(__name__)

# A turn of ControlServer.serve: the most messages it reads, and the most time it spends
# (64 pings take ~1 ms), before the passes and everything else on the event loop run again.
CONTROL_TURN_MESSAGES = 64
CONTROL_TURN_S = 0.002
# At shutdown, once intake has closed, the daemon reads on while messages keep coming, until
# the socket has been quiet for CLOSE_QUIET_S; a client that keeps sending cannot hold the
# exit beyond CLOSE_READ_MESSAGES or CLOSE_READ_S (ControlServer.answer_queued).
CLOSE_QUIET_S = 0.05
CLOSE_READ_MESSAGES = 100_000
CLOSE_READ_S = 1.0
SHUTTING_DOWN = "the daemon is shutting down"

Dispatch = Callable[[bytes, wire.ClientMessage, zmq.Frame], None]
# (identity, message id, error code, message): an `error` reply.
Error = Callable[[bytes, int | str | None, str, str], None]


def split_envelope(frames: list[bytes]) -> tuple[bytes, bool, bytes] | None:
    """(identity, REQ-style delimiter present, body), or None for a malformed envelope."""
    if len(frames) == 2:
        return frames[0], False, frames[1]
    if len(frames) == 3 and frames[1] == DELIMITER:
        return frames[0], True, frames[2]
    return None


class ControlReader:
    """Reads one ROUTER for a control server; `closing` (shutdown) refuses every message but
    `hello` and `ping` and reads only what is queued (`read_queued`)."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        clients: ClientTable,
        *,
        dispatch: Dispatch,
        error: Error,
        deadlines: Deadlines | None,
        clock: Callable[[], float],
    ) -> None:
        self._sock = sock
        self._clients = clients
        self._dispatch = dispatch
        self._error = error
        self._deadlines = deadlines
        self._clock = clock
        self._decoder = wire.ControlDecoder()
        # Malformed input is logged in bursts per client, not once per message.
        self._bad_log = LogThrottle()
        self.closing = False
        self.closing_reads = 0
        self._closing_ends = 0.0
        self._nowait: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        # The receive under way, if any: cancelling the reader while it waits loses nothing.
        self.receiving: Awaitable[list[zmq.Frame]] | None = None

    async def read(self) -> None:
        """Read until closing and nothing more is queued in time (or forever until then)."""
        sock = self._sock
        deadlines = self._deadlines
        clock = self._clock
        turn_ends = time.perf_counter() + CONTROL_TURN_S
        read = 0
        while True:
            if (
                read == CONTROL_TURN_MESSAGES
                or time.perf_counter() >= turn_ends
                or (read and deadlines is not None and deadlines.overdue(clock(), but=None))
            ):
                await asyncio.sleep(0)
                read = 0
                turn_ends = time.perf_counter() + CONTROL_TURN_S
            read += 1
            # Frames, not bytes: the last one carries the connection's role.
            if self.closing:
                queued = await self._queued()
                if queued is None:
                    return
                received = queued
            else:
                self.receiving = receiving = sock.recv_multipart(copy=False)
                received = await receiving
            frames = [frame.bytes for frame in received]
            envelope = split_envelope(frames)
            if envelope is None:
                held = self._bad_log.allow(frames[0])
                if held is not None:
                    log.warning(
                        "bad envelope",
                        frames=len(frames),
                        identity=frames[0].hex(),
                        **({"held_back": held} if held else {}),
                    )
                if len(frames) >= 2:
                    self._clients.send(
                        frames[0],
                        wire.ErrorReply(
                            code="bad_message",
                            message=(
                                "a message is one body frame, optionally after an empty delimiter"
                            ),
                        ),
                    )
                continue
            identity, delimited, body = envelope
            writable = self._clients.arrived(identity, delimited)
            try:
                msg = self._decoder.decode(body)
            except WireError as exc:
                if writable:
                    held = self._bad_log.allow(identity)
                    if held is not None:
                        log.warning(
                            "bad message",
                            identity=identity.hex(),
                            code=exc.code,
                            error=exc.message,
                            **({"held_back": held} if held else {}),
                        )
                    self._error(identity, exc.message_id, exc.code, exc.message)
                else:
                    self._clients.unanswered(identity, exc.message_id)
            else:
                if not writable:
                    self._clients.unanswered(identity, msg.id)
                elif self.closing and not isinstance(msg, wire.Hello | wire.Ping):
                    self._error(identity, msg.id, "shutting_down", SHUTTING_DOWN)
                else:
                    self._dispatch(identity, msg, received[-1])
            self._clients.settle(identity)

    async def read_queued(self) -> None:
        """Answer what clients have queued or are still sending, once the ranks stopped.
        Reading ends once the socket has been quiet for CLOSE_QUIET_S (at once when nothing
        came since intake closed), after CLOSE_READ_S, or at CLOSE_READ_MESSAGES since
        intake closed; what arrives later is never read."""
        self.closing = True
        self._closing_ends = time.monotonic() + CLOSE_READ_S
        await self.read()
        log.info("control socket drained", answered_while_closing=self.closing_reads)

    async def _queued(self) -> list[zmq.Frame] | None:
        """The next message while closing, if one comes in time (`answer_queued`)."""
        while self.closing_reads < CLOSE_READ_MESSAGES:
            try:
                frames = self._nowait.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = min(self._closing_ends - time.monotonic(), CLOSE_QUIET_S)
                if not self.closing_reads or left <= 0:
                    return None
                if not await self._sock.poll(left * 1000):
                    return None
                continue
            self.closing_reads += 1
            return frames
        return None
