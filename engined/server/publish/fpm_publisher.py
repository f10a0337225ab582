"""Forward-pass metrics of one data-parallel rank: a PUB socket in Dynamo's FPM v1 frames.

`[b"", seq(8B BE), payload]` per executed pass, `counter_id` = seq; when the rank is idle, an
all-zero heartbeat 1 s after the last message and then every second, so a planner can tell
an idle worker from a dead one (protocol.md §3).

The engine loop drives the heartbeat: it knows when it is idle, so it calls
`maybe_heartbeat(now)` (and can wait until `next_heartbeat_at`); `publish()` after a pass
moves the same deadline, so nothing is sent twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import structlog
import zmq
import zmq.asyncio

from engined.core.types import FpmSnapshot
from engined.server.security.gatekeeper import Domain, Gatekeeper
from engined.wire.fpm_schema import encode_fpm, heartbeat
from engined.wire.kv_events import seq_bytes
from engined.zmq_sockets import SocketRegistry, bound_endpoint, nonblocking_sender

log = structlog.get_logger()

HEARTBEAT_INTERVAL_S: Final = 1.0
DEFAULT_PUB_HWM: Final = 10_000
_TOPIC: Final = b""


class FpmPublisher:
    """PUB socket of one rank; every message, heartbeat or not, takes the next seq.

    Args:
        ctx: asyncio context shared by the daemon's sockets.
        registry: owns (and later closes) the socket made here.
        endpoint: PUB endpoint of this rank, bound (the caller has offset the port).
        worker_id: Dynamo's worker id, written into every message.
        dp_rank: written into every message.
        heartbeat_interval: seconds of silence before a heartbeat, and between heartbeats.
        clock: monotonic seconds; the deadlines and `maybe_heartbeat(now)` use it.
        hwm: PUB send high-water mark per subscriber.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        *,
        endpoint: str,
        worker_id: str,
        dp_rank: int,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        hwm: int = DEFAULT_PUB_HWM,
        gate: Gatekeeper | None = None,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self._worker_id = worker_id
        self._dp_rank = dp_rank
        self._interval = heartbeat_interval
        self._clock = clock
        self._next_seq = 0
        self._dropped = 0
        self._dropping = False  # inside a run of refused sends (logged once per run)
        self._next_heartbeat = clock() + heartbeat_interval
        self._log = log.bind(dp_rank=dp_rank)
        security = gate.options(Domain.PUBLISH) if gate is not None else {}
        self._pub = registry.make(
            ctx, zmq.PUB, endpoint, bind=True, sndhwm=hwm, rcvhwm=hwm, **security
        )
        self._send = nonblocking_sender(self._pub)
        self.endpoint = bound_endpoint(self._pub, endpoint)

    @property
    def next_seq(self) -> int:
        """The seq (= counter_id) of the next message."""
        return self._next_seq

    @property
    def worker_id(self) -> str:
        """The `worker_id` of every message from now on (a Dynamo worker sets its own)."""
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str) -> None:
        self._worker_id = value

    @property
    def next_heartbeat_at(self) -> float:
        """When, on `clock`, a heartbeat is due if no pass is published before."""
        return self._next_heartbeat

    @property
    def dropped(self) -> int:
        """Messages libzmq refused (EAGAIN); their seqs are consumed anyway."""
        return self._dropped

    def publish(self, snapshot: FpmSnapshot) -> None:
        """Send the metrics of one executed pass; never blocks, postpones the heartbeat."""
        seq = self._take_seq()
        self._send_payload(
            seq,
            encode_fpm(snapshot, worker_id=self._worker_id, dp_rank=self._dp_rank, counter_id=seq),
        )

    def heartbeat(self) -> None:
        """Send an all-zero heartbeat now (and restart the idle countdown)."""
        seq = self._take_seq()
        self._send_payload(
            seq, heartbeat(worker_id=self._worker_id, dp_rank=self._dp_rank, counter_id=seq)
        )

    def maybe_heartbeat(self, now: float) -> None:
        """Send a heartbeat if `now` (on `clock`) has reached the deadline.

        Whether one went out shows in `next_seq`; returns nothing so any engine loop sink
        protocol declaring `-> None` accepts this publisher.
        """
        if now >= self._next_heartbeat:
            self.heartbeat()

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        self._next_heartbeat = self._clock() + self._interval
        return seq

    def _send_payload(self, seq: int, payload: bytes) -> None:
        if self._send((_TOPIC, seq_bytes(seq), payload)):
            self._dropping = False
            return
        if not self._dropping:
            self._log.warning("fpm message dropped", seq=seq)
        self._dropped += 1
        self._dropping = True


class NullFpmPublisher:
    """The publisher when forward-pass metrics are off: same interface, does nothing."""

    endpoint: str | None = None
    worker_id: str = ""

    @property
    def next_seq(self) -> int:
        return 0

    def publish(self, snapshot: FpmSnapshot) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def maybe_heartbeat(self, now: float) -> None:
        pass
