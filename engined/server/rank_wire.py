"""The frames between the daemon and its rank worker processes (one ZeroMQ PAIR each).

Private to one daemon: both ends are the same build, so there is no versioning. msgpack
through msgspec, as every other engined frame. The core's structs travel as they are where
msgspec can decode them; its untagged unions (commands, command results, KV events) cannot
be decoded as unions, so commands carry their kind as an index (`COMMAND_TYPES`) and results
travel as (kind, text). KV events never cross: the worker publishes them itself.

Daemon -> worker: one frame per command, `[corr, rank, kind, command]`; `kind` >= CONTROL
is a control message instead (stop a rank, set the FPM worker id).

Worker -> daemon: one frame per event-loop turn or two, a list of tagged items in the order
the worker's ranks produced them, so the daemon replays them in that order: replies and
failures (by correlation id), passes (what the pass observers read), outputs and lifecycle
deliveries, and gauges (what `stats`, `load`, `/metrics` and the systemd status read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, cast

import msgspec
import zmq
import zmq.asyncio

from engined.core import errors
from engined.core import types as core
from engined.core.kv_residency import KvBlockEviction

COMMAND_TYPES: Final[tuple[type[Any], ...]] = (
    core.Submit,
    core.Cancel,
    core.SubmitHandoffPrefill,
    core.ReleaseSource,
    core.CancelSource,
    core.ReserveDestination,
    core.ActivateDestination,
    core.CancelDestination,
    core.SetVocabulary,
    core.ResetPrefixCache,
)
COMMAND_KIND: Final[dict[type[Any], int]] = {cls: i for i, cls in enumerate(COMMAND_TYPES)}
CONTROL: Final = 100
STOP: Final = CONTROL  # body: None; stop that rank once drained
FPM_WORKER_ID: Final = CONTROL + 1  # body: the new worker id of that rank
UNTIL_IDLE: Final = CONTROL + 2  # body: None; answered by `Done(corr)` once the rank is idle
GAUGES: Final = CONTROL + 3  # body: None; answered by the rank's full `Gauges`, then `Done(corr)`

# Command results as (kind, text): text is the request id or the refusal's reason.
_RESULTS: Final[tuple[type[Any], ...]] = (
    core.Submitted,
    core.DestinationAccepted,
    core.Applied,
    core.Noop,
    core.Refused,
)


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
    corr: int
    rank: int
    arrived_ms: float
    result_kind: int
    result_text: str
    ended: list[core.EndedRequest]
    lifecycle_events: list[core.LifecycleEvent]
    progressed: bool
    metrics: core.EngineMetrics  # after the command: the command observers read them
    num_waiting: int


class Failure(msgspec.Struct, frozen=True, tag="failure", array_like=True):
    corr: int
    rank: int
    error_class: str
    code: str
    message: str


class Pass(msgspec.Struct, frozen=True, tag="pass", array_like=True, gc=False):
    """A `PassResult` without what stays in the worker (KV events, FPM, lifecycle events)."""

    rank: int
    start_ms: float
    end_ms: float
    outputs: list[core.RequestOutput]
    ended: list[core.EndedRequest]
    admissions: list[core.Admission]
    metrics: core.EngineMetrics
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    accept_length_output_tokens: int
    accept_length_decode_forwards: int
    decodes: core.Decodes
    kv_block_evictions: list[KvBlockEviction]


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
    num_waiting: int = 0
    lateness: tuple[float, float, float] | None = None
    # The replay server's (abandoned, refused, streaming), when replay is on.
    replay: tuple[int, int, int] | None = None


class Done(msgspec.Struct, frozen=True, tag="done", array_like=True):
    """Request `corr` is answered: an `UNTIL_IDLE` (the rank's `until_idle` returned, so
    everything before it was applied and delivered) or a `GAUGES` (its `Gauges` came first)."""

    corr: int


class Stopped(msgspec.Struct, frozen=True, tag="stopped", array_like=True):
    """The worker's last message: every rank drained, nothing follows."""


Item = (
    Ready | StartupFailed | Reply | Failure | Pass | Outputs | Lifecycle | Gauges | Done | Stopped
)

encoder: Final = msgspec.msgpack.Encoder()
item_decoder: Final = msgspec.msgpack.Decoder(list[Item])
command_header_decoder: Final = msgspec.msgpack.Decoder(tuple[int, int, int, msgspec.Raw])
command_decoders: Final[tuple[msgspec.msgpack.Decoder[Any], ...]] = tuple(
    msgspec.msgpack.Decoder(cls) for cls in COMMAND_TYPES
)
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


def encode_result(result: core.CommandResult) -> tuple[int, str]:
    match result:
        case core.Submitted(request_id) | core.DestinationAccepted(request_id):
            text = request_id
        case core.Refused(reason):
            text = reason
        case _:
            text = ""
    return _RESULTS.index(type(result)), text


def decode_result(kind: int, text: str) -> core.CommandResult:
    """The result back; Applied and Noop as the core's singletons (callers compare by `is`)."""
    match _RESULTS[kind]:
        case core.Submitted:
            return core.Submitted(text)
        case core.DestinationAccepted:
            return core.DestinationAccepted(text)
        case core.Applied:
            return core.APPLIED
        case core.Noop:
            return core.NOOP
    return core.Refused(text)


def rebuild_error(error_class: str, code: str, message: str) -> errors.CoreError:
    """The `CoreError` subclass the worker's core raised, with its code and message.

    Built without the subclass's `__init__` (DuplicateRequestError's takes a request id, not
    a message): what the daemon reads of it is `code` and `str(exc)`.
    """
    cls = getattr(errors, error_class, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CoreError)):
        cls = errors.CoreError
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.code = code
    return exc
