"""The control ROUTER: decode and validate client messages, dispatch them to ranks, and
route every reply, output and lifecycle event back to the client that owns it.

Ownership is explicit: a request belongs to the identity that submitted it, a handoff to the
identity that registered it (per side: source or destination). Outputs of one pass are
grouped per client, one `output` message each. Sends never block the engine: the socket is
ROUTER_MANDATORY, so a vanished client is noticed at the first send to it, and its requests
are cancelled and their KV freed, exactly once.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined.core import types as core
from engined.core.errors import CoreError
from engined.core.scheduler import VllmCore
from engined.server.engine_loop import EngineLoop
from engined.server.load import LoadWatch
from engined.server.settings import RuntimeSettings
from engined.wire import control as wire
from engined.wire.convert import group_outputs, rank_stats, to_core_request, to_wire_lifecycle
from engined.wire.errors import WireError

log = structlog.get_logger(__name__)

DELIMITER = b""
# A turn of ControlServer.serve: the most messages it reads, and the most time it spends
# (64 pings take ~1 ms), before the passes and everything else on the event loop run again.
CONTROL_TURN_MESSAGES = 64
CONTROL_TURN_S = 0.002


def split_envelope(frames: list[bytes]) -> tuple[bytes, bool, bytes] | None:
    """(identity, REQ-style delimiter present, body), or None for a malformed envelope."""
    if len(frames) == 2:
        return frames[0], False, frames[1]
    if len(frames) == 3 and frames[1] == DELIMITER:
        return frames[0], True, frames[2]
    return None


@dataclass(slots=True)
class HandoffRoute:
    rank: int
    identity: bytes
    request_id: str
    # Monotonic time after which the handoff session is abandoned (None: not timed).
    deadline: float | None = None


class ControlServer:
    """Client protocol v1 over one ROUTER socket."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        loops: list[EngineLoop],
        *,
        welcome: Callable[[], wire.Welcome],
        settings: RuntimeSettings,
        max_queued_requests: int,
        handoff_timeout_s: float | None = None,
    ) -> None:
        self._sock = sock
        # Sends go through a synchronous shadow: NOBLOCK, errors raised at the call.
        self._send_sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._loops = loops
        self._welcome = welcome
        self._settings = settings
        self._load = LoadWatch(loops, self._send)
        self._max_queued = max_queued_requests
        self._handoff_timeout_s = handoff_timeout_s
        self._decoder = wire.ControlDecoder()
        self._encode = msgspec.msgpack.Encoder().encode
        self._rr = itertools.cycle(range(len(loops)))
        self._delimited: dict[bytes, bool] = {}
        # request id -> identity, per rank
        self._owners: list[dict[str, bytes]] = [{} for _ in loops]
        self._sources: dict[str, HandoffRoute] = {}
        self._destinations: dict[str, HandoffRoute] = {}
        # request id -> destination handoff id, per rank: the route ends with the request.
        self._destination_requests: list[dict[str, str]] = [{} for _ in loops]
        self._gone: set[bytes] = set()
        self.shutting_down = False
        # Set whenever a request stops being owned; shutdown waits on it to drain.
        self.owners_changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # Set when a handler fails unexpectedly: a bug, which must end the daemon non-zero.
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    # --- reading ------------------------------------------------------------------------

    async def serve(self) -> None:
        """Read and dispatch client messages, yielding to the event loop between turns.

        A turn is at most CONTROL_TURN_MESSAGES messages or CONTROL_TURN_S seconds. NOTE:
        while messages are queued, pyzmq's recv returns a completed future and awaiting it
        does not yield; unbounded, a burst of pings or garbage held every pass, publisher,
        signal and watchdog ping until it was drained. The ROUTER fair-queues its peers, so
        a flooder's backlog delays the flooder, not the other clients.
        """
        sock = self._sock
        turn_ends = time.perf_counter() + CONTROL_TURN_S
        read = 0
        while True:
            if read == CONTROL_TURN_MESSAGES or time.perf_counter() >= turn_ends:
                await asyncio.sleep(0)
                read = 0
                turn_ends = time.perf_counter() + CONTROL_TURN_S
            read += 1
            frames = await sock.recv_multipart()
            envelope = split_envelope(frames)
            if envelope is None:
                log.warning("bad envelope", frames=len(frames), identity=frames[0].hex())
                if len(frames) >= 2:
                    self._reply(
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
            self._delimited[identity] = delimited
            self._gone.discard(identity)
            try:
                msg = self._decoder.decode(body)
            except WireError as exc:
                log.warning(
                    "bad message", identity=identity.hex(), code=exc.code, error=exc.message
                )
                self._reply(
                    identity, wire.ErrorReply(id=exc.message_id, code=exc.code, message=exc.message)
                )
                continue
            self._dispatch(identity, msg)

    def _dispatch(self, identity: bytes, msg: wire.ClientMessage) -> None:
        match msg:
            case wire.Hello():
                welcome = self._welcome()
                welcome.id = msg.id
                self._reply(identity, welcome)
            case wire.Ping():
                self._reply(identity, wire.Pong(id=msg.id))
            case wire.Stats():
                self._reply(identity, self.stats(msg.id))
            case wire.Submit() | wire.SubmitHandoffPrefill() | wire.ReserveDestination():
                self._spawn(self._submit(identity, msg))
            case wire.Cancel():
                self._spawn(self._cancel(identity, msg))
            case wire.ReleaseSource() | wire.CancelSource():
                self._spawn(self._handoff_command(identity, msg, self._sources))
            case wire.ActivateDestination() | wire.CancelDestination():
                self._spawn(self._handoff_command(identity, msg, self._destinations))
            case wire.ResetPrefixCache():
                self._spawn(self._reset_prefix_cache(identity, msg))
            case wire.SetVocabulary():
                self._spawn(self._set_vocabulary(identity, msg))
            case wire.SetFpmWorkerId():
                self._settings.set_fpm_worker_id(msg.worker_id)
                self._reply(identity, wire.Applied(id=msg.id))
            case wire.WatchLoad():
                self._reply(identity, wire.Applied(id=msg.id))
                self._load.watch(identity)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self.failed.done():
            self.failed.set_result(exc)

    # --- requests and commands ----------------------------------------------------------

    def _error(self, identity: bytes, msg_id: int | str | None, code: str, message: str) -> None:
        self._reply(identity, wire.ErrorReply(id=msg_id, code=code, message=message))  # type: ignore[arg-type]

    def _pick_rank(self, requested: int | None) -> int | None:
        if requested is None:
            return next(self._rr)
        return requested if requested < len(self._loops) else None

    async def _submit(
        self,
        identity: bytes,
        msg: wire.Submit | wire.SubmitHandoffPrefill | wire.ReserveDestination,
    ) -> None:
        if self.shutting_down:
            self._error(identity, msg.id, "shutting_down", "the daemon is shutting down")
            return
        request = msg.request
        rank = self._pick_rank(request.dp_rank)
        if rank is None:
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"request.dp_rank: {request.dp_rank} is out of range [0, {len(self._loops)})",
            )
            return
        loop = self._loops[rank]
        capacity = loop.core.num_blocks * loop.core.block_size
        # NOTE: a destination's prompt is left to the core, which refuses it with `capacity`.
        if len(request.token_ids) > capacity and not isinstance(msg, wire.ReserveDestination):
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"request.token_ids: {len(request.token_ids)} tokens exceed the KV pool "
                f"capacity of {capacity} tokens",
            )
            return
        if self._max_queued and len(loop.core.state.waiting) + loop.queued >= self._max_queued:
            self._error(
                identity,
                msg.id,
                "overloaded",
                f"rank {rank} has {self._max_queued} queued requests",
            )
            return
        request_id = request.request_id or str(uuid.uuid4())
        core_request = to_core_request(request)
        if request.request_id is None:
            core_request = msgspec.structs.replace(core_request, request_id=request_id)
        routes: dict[str, HandoffRoute] | None = None
        command: core.Command
        match msg:
            case wire.Submit():
                command = core.Submit(core_request)
            case wire.SubmitHandoffPrefill():
                routes = self._sources
                command = core.SubmitHandoffPrefill(msg.handoff_id, core_request)
            case wire.ReserveDestination():
                routes = self._destinations
                command = core.ReserveDestination(msg.handoff_id, core_request)
        new_route: HandoffRoute | None = None
        if routes is not None:
            existing = routes.get(msg.handoff_id)  # type: ignore[union-attr]
            if existing is not None:
                # The core that owns the handoff id must see the duplicate and refuse it.
                rank, loop = existing.rank, self._loops[existing.rank]
            else:
                new_route = routes[msg.handoff_id] = HandoffRoute(rank, identity, request_id)  # type: ignore[union-attr]
                if routes is self._destinations:
                    self._destination_requests[rank][request_id] = msg.handoff_id  # type: ignore[union-attr]
                    new_route.deadline = self._handoff_deadline()
        owners = self._owners[rank]
        if request_id in owners:
            if new_route is not None and routes is not None:
                routes.pop(msg.handoff_id, None)  # type: ignore[union-attr]
                self._destination_requests[rank].pop(request_id, None)
            self._error(
                identity, msg.id, "duplicate_request", f"request {request_id} is already active"
            )
            return
        owners[request_id] = identity
        try:
            effects = await loop.call(command)
        except CoreError as exc:
            if owners.get(request_id) is identity:
                del owners[request_id]
            if new_route is not None and routes is not None:
                routes.pop(msg.handoff_id, None)  # type: ignore[union-attr]
                self._destination_requests[rank].pop(request_id, None)
            self._error(identity, msg.id, exc.code, str(exc))
            return
        if isinstance(effects.result, core.DestinationAccepted):
            self._reply(
                identity, wire.DestinationAccepted(id=msg.id, request_id=request_id, dp_rank=rank)
            )
        else:
            self._reply(identity, wire.Submitted(id=msg.id, request_id=request_id, dp_rank=rank))

    async def _cancel(self, identity: bytes, msg: wire.Cancel) -> None:
        for rank, owners in enumerate(self._owners):
            if msg.request_id in owners:
                effects = await self._loops[rank].call(core.Cancel(msg.request_id))
                if isinstance(effects.result, core.Applied):
                    self._forget(rank, msg.request_id)
                    self._reply(identity, wire.Applied(id=msg.id))
                    return
        self._reply(identity, wire.Noop(id=msg.id))

    async def _handoff_command(
        self,
        identity: bytes,
        msg: wire.ReleaseSource
        | wire.CancelSource
        | wire.ActivateDestination
        | wire.CancelDestination,
        routes: dict[str, HandoffRoute],
    ) -> None:
        route = routes.get(msg.handoff_id)
        if route is None:
            self._reply(identity, wire.Noop(id=msg.id))
            return
        command: core.Command
        match msg:
            case wire.ReleaseSource():
                command = core.ReleaseSource(msg.handoff_id)
            case wire.CancelSource():
                command = core.CancelSource(msg.handoff_id)
            case wire.ActivateDestination():
                command = core.ActivateDestination(msg.handoff_id)
            case wire.CancelDestination():
                command = core.CancelDestination(msg.handoff_id)
        loop = self._loops[route.rank]
        effects = await loop.call(command)
        applied = isinstance(effects.result, core.Applied)
        if applied and isinstance(msg, wire.ActivateDestination):
            route.deadline = None
        if applied and not isinstance(msg, wire.ActivateDestination):
            routes.pop(msg.handoff_id, None)
            if routes is self._destinations:
                self._destination_requests[route.rank].pop(route.request_id, None)
            self._end_dropped(route.rank, route.request_id, loop.core)
        self._reply(identity, wire.Applied(id=msg.id) if applied else wire.Noop(id=msg.id))

    # --- handoff session timeout -------------------------------------------------------

    def _handoff_deadline(self) -> float | None:
        timeout = self._handoff_timeout_s
        return None if timeout is None else time.monotonic() + timeout

    async def expire_handoffs(self) -> None:
        """Abandon handoff sessions whose coordinator went quiet (handoff_session_timeout_ms).

        A held source not released, or a destination not activated, within the timeout is
        cancelled as if the coordinator had sent cancel_source / cancel_destination, so a
        vanished coordinator cannot pin KV blocks for the lifetime of the daemon.
        """
        timeout = self._handoff_timeout_s
        if timeout is None:
            return
        interval = min(1.0, timeout / 2)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for routes, command in (
                (self._sources, core.CancelSource),
                (self._destinations, core.CancelDestination),
            ):
                for handoff_id, route in list(routes.items()):
                    if route.deadline is None or route.deadline > now:
                        continue
                    route.deadline = None
                    loop = self._loops[route.rank]
                    effects = await loop.call(command(handoff_id))
                    if isinstance(effects.result, core.Applied) and routes.get(handoff_id) is route:
                        del routes[handoff_id]
                        self._destination_requests[route.rank].pop(route.request_id, None)
                        self._end_dropped(route.rank, route.request_id, loop.core)
                        log.warning(
                            "handoff timed out", handoff_id=handoff_id, request_id=route.request_id
                        )

    def _end_dropped(self, rank: int, request_id: str, core_: VllmCore) -> None:
        """A command dropped a request another client may be streaming: end its stream."""
        owner = self._owners[rank].get(request_id)
        if owner is not None and request_id not in core_.state.requests:
            self._forget(rank, request_id)
            entry = wire.OutputEntry(
                request_id=request_id, token_ids=[], finished=True, finish_reason="cancelled"
            )
            self._send(owner, wire.Output(dp_rank=rank, outputs=[entry]))

    async def _reset_prefix_cache(self, identity: bytes, msg: wire.ResetPrefixCache) -> None:
        ranks = range(len(self._loops)) if msg.dp_rank is None else [msg.dp_rank]
        if msg.dp_rank is not None and msg.dp_rank >= len(self._loops):
            self._error(
                identity, msg.id, "invalid_request", f"dp_rank: {msg.dp_rank} is out of range"
            )
            return
        refused = []
        for rank in ranks:
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._loops[rank].post(functools.partial(_reset_into, future))
            if not await future:
                refused.append(rank)
        if refused:
            self._error(
                identity,
                msg.id,
                "invalid_request",
                f"reset_prefix_cache: rank(s) {refused} still hold KV blocks in use",
            )
        else:
            self._reply(identity, wire.Applied(id=msg.id))

    async def _set_vocabulary(self, identity: bytes, msg: wire.SetVocabulary) -> None:
        """Every rank or none: the cores validate alike, so only the first can refuse."""
        command = core.SetVocabulary(msg.vocab_size, tuple(msg.excluded_token_ids))
        for loop in self._loops:
            try:
                await loop.call(command)
            except CoreError as exc:
                self._error(identity, msg.id, exc.code, str(exc))
                return
        self._settings.vocabulary_applied(msg.vocab_size, msg.excluded_token_ids)
        self._reply(identity, wire.Applied(id=msg.id))

    def stats(self, msg_id: int | str | None = None) -> wire.StatsReply:
        return wire.StatsReply(
            id=msg_id,
            ranks=[
                rank_stats(
                    loop.core.metrics(),
                    passes_total=loop.passes_total,
                    lateness_ms=loop.lateness_summary(),
                )
                for loop in self._loops
            ],
        )

    # --- delivery (called by the engine loops) ------------------------------------------

    def deliver_outputs(self, rank: int, signals: list[core.OutputSignal]) -> None:
        owners = self._owners[rank]
        per_client: dict[bytes, list[core.OutputSignal]] = defaultdict(list)
        for signal in signals:
            owner = owners.get(signal.request_id)
            if owner is not None:
                per_client[owner].append(signal)
            if signal.completed:
                self._forget(rank, signal.request_id)
        for identity, batch in per_client.items():
            self._send(identity, wire.Output(dp_rank=rank, outputs=group_outputs(batch)))

    def _forget(self, rank: int, request_id: str) -> None:
        """A request ended: drop its owner and any destination route it had."""
        if self._owners[rank].pop(request_id, None) is not None:
            self.owners_changed.set()
        handoff_id = self._destination_requests[rank].pop(request_id, None)
        if handoff_id is not None:
            self._destinations.pop(handoff_id, None)

    def deliver_lifecycle(self, rank: int, events: list[core.LifecycleEvent]) -> None:
        per_client: dict[bytes, list[wire.WireLifecycleEvent]] = defaultdict(list)
        for event in events:
            routes = self._sources if isinstance(event, core.SourceHeld) else self._destinations
            route = routes.get(event.handoff_id)
            if route is not None and route.rank == rank:
                per_client[route.identity].append(to_wire_lifecycle(event))
                if isinstance(event, core.SourceHeld):
                    route.deadline = self._handoff_deadline()
        for identity, batch in per_client.items():
            self._send(identity, wire.Lifecycle(dp_rank=rank, events=batch))

    def cancel_all(self, finish_reason: str = "cancelled") -> None:
        """End every request still owned (shutdown after the drain timeout)."""
        for rank, owners in enumerate(self._owners):
            loop = self._loops[rank]
            for request_id, identity in list(owners.items()):
                loop.core.cancel(request_id)
                entry = wire.OutputEntry(
                    request_id=request_id, token_ids=[], finished=True, finish_reason="cancelled"
                )
                self._send(identity, wire.Output(dp_rank=rank, outputs=[entry]))
                self._forget(rank, request_id)

    def owned_requests(self) -> int:
        return sum(len(owners) for owners in self._owners)

    # --- sending ------------------------------------------------------------------------

    def _reply(self, identity: bytes, msg: wire.DaemonMessage) -> None:
        self._send(identity, msg)

    def _send(self, identity: bytes, msg: wire.DaemonMessage) -> None:
        if identity in self._gone:
            return
        body = self._encode(msg)
        frames = [identity, DELIMITER, body] if self._delimited.get(identity) else [identity, body]
        try:
            self._send_sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(
                identity, "unreachable" if exc.errno == errno.EHOSTUNREACH else "too slow"
            )
        finally:
            # NOTE: the ZMQ FD is edge-triggered, and a send through the shadow may consume
            # the edge announcing incoming messages, leaving serve()'s pending recv asleep
            # with messages queued. Reading EVENTS through the asyncio socket reschedules it
            # (pyzmq does the same after its own sends).
            self._sock.get(zmq.EVENTS)

    def _client_gone(self, identity: bytes, why: str) -> None:
        """Cancel everything the client owns on every rank, once."""
        self._gone.add(identity)
        self._delimited.pop(identity, None)
        self._load.forget(identity)
        cancelled = 0
        for rank, owners in enumerate(self._owners):
            mine = [rid for rid, owner in owners.items() if owner == identity]
            for request_id in mine:
                self._forget(rank, request_id)
                self._loops[rank].post(functools.partial(_cancel_quietly, request_id))
            cancelled += len(mine)
        log.warning("client gone", identity=identity.hex(), reason=why, cancelled=cancelled)


def _reset_into(future: asyncio.Future[bool], core_: VllmCore) -> None:
    future.set_result(core_.reset_prefix_cache())


def _cancel_quietly(request_id: str, core_: VllmCore) -> None:
    core_.cancel(request_id)
