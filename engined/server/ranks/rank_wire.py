"""The frames between the daemon and its rank worker processes (one ZeroMQ PAIR each).

Private to one daemon: both ends are the same build, so there is no versioning. msgpack
through msgspec, as every other engined frame. The core's values travel as they are: its
commands and their results are tagged Structs, so their unions decode directly; a failed
command's `CoreError` travels as its value (`CoreFailure`) and is raised again by the daemon.
KV events never cross: the worker publishes them itself.

Daemon -> worker: one frame per command, `[corr, rank, order]`, where an order is a core
command or a control message (stop a rank, set the FPM worker id, wait until idle, send the
full gauges).

Worker -> daemon: one frame per event-loop turn or two, a list of tagged items in the order
the worker's ranks produced them, so the daemon replays them in that order: replies and
failures (by correlation id), passes (what the pass observers read), outputs and lifecycle
deliveries, and gauges (what `stats`, `load`, `/metrics` and the systemd status read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

import msgspec
import zmq
import zmq.asyncio

from engined.core import types as core
from engined.core.command_report import CommandReport
from engined.core.errors import CoreFailure
from engined.core.pass_report import PassReport


class StopRank(msgspec.Struct, frozen=True, tag=True):
    """Stop the rank once drained."""


class SetFpmWorkerId(msgspec.Struct, frozen=True, tag=True):
    worker_id: str


class UntilIdle(msgspec.Struct, frozen=True, tag=True):
    """Answered by `Done(corr)` once the rank is idle."""


class SendGauges(msgspec.Struct, frozen=True, tag=True):
    """Answered by the rank's full `Gauges`, then `Done(corr)`."""


Order = core.Command | StopRank | SetFpmWorkerId | UntilIdle | SendGauges


class RankInit(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker is told on its stdin: the daemon's configuration and its share of it."""

    config: bytes  # DaemonConfig as JSON, decoded by the worker
    ranks: list[int]
    endpoint: str  # the PAIR the daemon bound
    worker_id: str  # the FPM worker id in force (the daemon's hostname:pid)
    parent_pid: int
    heartbeat_s: float


class RankReady(msgspec.Struct, frozen=True, array_like=True):
    rank: int
    kv_endpoint: str | None  # None: KV events are off
    replay_endpoint: str | None
    fpm_endpoint: str | None
    # The blocks requests can hold (`Engine.usable_blocks`): the prompt capacity check's.
    num_blocks: int
    block_size: int
    kv_hwm: int
    replay_hwm: int
    metrics: core.EngineMetrics  # the gauges before any command


class Ready(msgspec.Struct, frozen=True, tag="ready", array_like=True):
    ranks: list[RankReady]
    batch_bytes: int


class StartupFailed(msgspec.Struct, frozen=True, tag="startup_failed", array_like=True):
    error: str


class Reply(msgspec.Struct, frozen=True, tag="reply", array_like=True, gc=False):
    """A command's report, as the worker's command observer took it (its KV events and
    lifecycle events stay in the worker: its publishers and `Lifecycle` carry them)."""

    corr: int
    rank: int
    arrived_ms: float
    report: CommandReport
    metrics: core.EngineMetrics  # after the command: the command observers read them


class Failure(msgspec.Struct, frozen=True, tag="failure", array_like=True):
    corr: int
    rank: int
    error: CoreFailure


class Pass(msgspec.Struct, frozen=True, tag="pass", array_like=True, gc=False):
    """A pass's report, as the worker's pass observer took it (its KV events, FPM snapshot
    and lifecycle events stay in the worker: its publishers and `Lifecycle` carry them)."""

    rank: int
    start_ms: float
    report: PassReport


class Outputs(msgspec.Struct, frozen=True, tag="outputs", array_like=True, gc=False):
    rank: int
    # None: the outputs (and decodes) of the rank's latest `Pass` (sent once, not twice).
    outputs: list[core.RequestOutput] | None
    decodes: core.Decodes | None


class Lifecycle(msgspec.Struct, frozen=True, tag="lifecycle", array_like=True):
    rank: int
    events: list[core.LifecycleEvent]


class Gauges(msgspec.Struct, frozen=True, tag="gauges", array_like=True, gc=False):
    rank: int
    now_ms: float
    passes_total: int
    tokens_total: int
    kv_overflows: int
    # Heartbeats only: the engine gauges and lateness (sorting the window costs ~10 ms).
    metrics: core.EngineMetrics | None = None
    lateness: tuple[float, float, float] | None = None
    # The replay server's (abandoned, refused, streaming), when replay is on.
    replay: tuple[int, int, int] | None = None


class Done(msgspec.Struct, frozen=True, tag="done", array_like=True):
    """Request `corr` is answered: an `UntilIdle` (the rank's `until_idle` returned, so
    everything before it was applied and delivered) or a `SendGauges` (its `Gauges` came
    first)."""

    corr: int


class Stopped(msgspec.Struct, frozen=True, tag="stopped", array_like=True):
    """The worker's last message: every rank drained, nothing follows."""


Item = (
    Ready | StartupFailed | Reply | Failure | Pass | Outputs | Lifecycle | Gauges | Done | Stopped
)

encoder: Final = msgspec.msgpack.Encoder()
item_decoder: Final = msgspec.msgpack.Decoder(list[Item])
order_decoder: Final = msgspec.msgpack.Decoder(tuple[int, int, Order])
init_decoder: Final = msgspec.msgpack.Decoder(RankInit)


# Frames from a worker that may wait unread, at each end of its PAIR: a worker more than
# this far ahead of the daemon blocks (`pair_sender(block=True)`) until the daemon catches up.
WORKER_FRAMES_AHEAD: Final = 16


def pair_sender(sock: zmq.asyncio.Socket, *, block: bool = False) -> Callable[[bytes], bool]:
    """A send on a socket this process also reads; False when refused (or closed).

    Without `block` it never blocks. With it, a full queue (the high-water mark) blocks the
    whole process until the peer reads: a worker at speedup 0 would otherwise run passes
    faster than the daemon delivers them and queue their frames without bound. The engine
    loop of the worker calls this synchronously, so blocking is the only way to hold it.

    NOTE: not `zmq_sockets.nonblocking_sender`: a send through a shadow socket can take the
    socket's (edge-triggered) readiness with it, and a pending asyncio `recv` then sleeps
    with a frame queued. The asyncio socket's own send re-arms its reader; after a blocking
    send through the shadow, reading EVENTS through the asyncio socket re-arms it.
    """
    shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)

    def send(frame: bytes) -> bool:
        if sock.closed:
            return False
        # pyzmq types the result as an Awaitable; it is an asyncio Future, done at once.
        sent = cast("asyncio.Future[object]", sock.send(frame, flags=zmq.NOBLOCK))
        if sent.done() and sent.exception() is None:
            return True
        if not block:
            return False
        shadow.send(frame)
        sock.get(zmq.EVENTS)
        return True

    return send
