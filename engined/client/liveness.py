"""Whether the daemon behind a client is there, and whether it is still the same start.

A DEALER never reports a dead peer by itself: it queues and reconnects in silence. The
socket monitor does report the connection's end (a killed daemon's socket closes at once),
and ZMTP heartbeats make libzmq end a connection whose peer stopped answering (a stopped or
partitioned host): a PING every `liveness_s / 4`, the connection dropped when nothing came
back within `liveness_s / 2` of one, so a loss is seen within 3/4 of the bound. No protocol
message is involved: libzmq answers PINGs below the protocol, in the daemon's I/O thread.

On a loss the connection fails everything that waits with `DaemonLost`; when a handshake
succeeds again, `hello` tells the daemon's `instance_id`, and a different one is a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engined.client.client_errors import DaemonLost
from engined.wire.control import Welcome

log = structlog.get_logger()

DEFAULT_LIVENESS_S: Final = 2.0
# A bound below this would have libzmq ping more often than every 25 ms: no real network
# needs that, and a busy daemon's I/O thread could miss it.
MIN_LIVENESS_S: Final = 0.1


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The daemon went away; every call raises `DaemonLost` until `ConnectionBack`."""

    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionBack:
    """The daemon answers again: `welcome` is its `hello` reply.

    `restarted` is True when its `instance_id` differs from the one this client knew (or
    either is unknown: a client that never read a `welcome`, a daemon older than the field):
    the daemon's requests, vocabulary, FPM worker id, `watch_load` and KV cache are then new.
    """

    welcome: Welcome
    restarted: bool


ConnectionEvent: TypeAlias = ConnectionLost | ConnectionBack


def heartbeat_ms(liveness_s: float) -> tuple[int, int]:
    """(ZMQ_HEARTBEAT_IVL, ZMQ_HEARTBEAT_TIMEOUT) in ms for a liveness bound in seconds.

    Raises:
        ValueError: a bound below MIN_LIVENESS_S (or not a number).
    """
    if not liveness_s >= MIN_LIVENESS_S:
        raise ValueError(f"liveness_s: expected at least {MIN_LIVENESS_S} s, got {liveness_s!r}")
    return max(1, round(liveness_s * 250)), max(1, round(liveness_s * 500))


class Liveness:
    """Reads the DEALER's monitor: refusals, losses and returns of the daemon.

    Collaborators: `refused(status)` ends the client for a refused handshake, `lost(exc)`
    fails what waits on the connection, `greet()` sends `hello` on a fresh connection even
    while calls are refused. `watch_losses` False (no liveness bound) keeps only refusals:
    the client then behaves as before heartbeats existed.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        *,
        watch_losses: bool,
        refused: Callable[[int], None],
        lost: Callable[[DaemonLost], None],
        greet: Callable[[], Awaitable[Welcome]],
    ) -> None:
        events = zmq.EVENT_HANDSHAKE_FAILED_AUTH
        if watch_losses:
            events |= zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        self._sock = sock
        self._monitor = sock.get_monitor_socket(events)
        self._refused = refused
        self._lost_callback = lost
        self._greet = greet
        self.instance_id: str | None = None
        self.lost: DaemonLost | None = None
        self.up = False
        self._greeter: asyncio.Task[None] | None = None
        self._events: asyncio.Queue[ConnectionEvent] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(
            self._watch(), name="engine-client-liveness"
        )

    async def close(self) -> None:
        self._task.cancel()
        if self._greeter is not None:
            self._greeter.cancel()
        for task in (self._task, self._greeter):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._sock.disable_monitor()
        self._monitor.close(linger=0)

    def heard(self) -> None:
        """The daemon spoke: the connection is up even if its HANDSHAKE_SUCCEEDED came
        before the monitor was attached (libzmq connects in the background at once)."""
        if self.lost is None:
            self.up = True

    def saw_welcome(self, welcome: Welcome) -> None:
        """Remember the daemon's start from any `welcome` this client reads."""
        if welcome.instance_id is not None:
            self.instance_id = welcome.instance_id

    async def next_event(self, timeout: float | None) -> ConnectionEvent:
        async with asyncio.timeout(timeout):
            return await self._events.get()

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                # libzmq does not try a refused endpoint again: the client is done.
                self._refused(int(event["value"]))
                return
            if kind == zmq.EVENT_DISCONNECTED:
                self._disconnected()
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken()

    def _disconnected(self) -> None:
        if self._greeter is not None:
            self._greeter.cancel()
            self._greeter = None
        if not self.up:
            return  # a connection that never completed its handshake, or one already lost
        self.up = False
        self.lost = DaemonLost("the engined daemon went away (connection dropped or silent)")
        log.warning("engined daemon lost", instance_id=self.instance_id)
        self._lost_callback(self.lost)
        self._events.put_nowait(ConnectionLost(str(self.lost)))

    def _handshaken(self) -> None:
        if self.lost is None:
            self.up = True  # the first connection: the caller's own `hello` comes
            return
        if self._greeter is None:
            self._greeter = asyncio.get_running_loop().create_task(
                self._back(), name="engine-client-greeter"
            )

    async def _back(self) -> None:
        """`hello` until the daemon answers; a silent one is dropped by the heartbeat."""
        # Read before the reply lands: the reader records every welcome it sees.
        known = self.instance_id
        while True:
            try:
                welcome = await self._greet()
            except TimeoutError:
                continue
            except Exception:
                # Stay lost: the next handshake tries again.
                log.exception("hello to the returning daemon failed")
                self._greeter = None
                return
            break
        restarted = known is None or welcome.instance_id is None or welcome.instance_id != known
        self.saw_welcome(welcome)
        self.up = True
        self.lost = None
        self._greeter = None
        log.info("engined daemon back", instance_id=welcome.instance_id, restarted=restarted)
        self._events.put_nowait(ConnectionBack(welcome, restarted))
