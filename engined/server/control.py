"""The control ROUTER: decode and validate client messages, dispatch them to ranks, and
route every reply, output and lifecycle event back to the client that owns it.

Ownership (`engined.server.ownership`) is explicit: a request belongs to the identity that
submitted it, a handoff to the identity that registered it (per side: source or
destination), and every way a request ends early goes through one place that tells the
owner exactly once. Outputs of one pass are grouped per client, one `output` message each.
Sends never block the engine (`engined.server.clients`): a client that is gone or does not
read is dropped, its requests are cancelled and their KV freed, and it is told what happened
once it reads again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined.config.schema import CONTROL_INFLIGHT_BYTES, CONTROL_UNREAD_BYTES
from engined.core import types as core
from engined.core.errors import CoreError
from engined.server.budgets import over_budget, request_bytes
from engined.server.clients import DELIMITER, ClientTable, Episode
from engined.server.deadlines import Deadlines
from engined.server.gatekeeper import ROLE_PROPERTY, Role
from engined.server.load import LoadWatch
from engined.server.log_throttle import LogThrottle
from engined.server.ownership import HandoffRoute, Ownership
from engined.server.rank_handle import RankHandle
from engined.server.reports import Reports
from engined.server.request_ids import RequestIds
from engined.server.settings import RuntimeSettings
from engined.wire import control as wire
from engined.wire.convert import route_outputs, to_core_command, to_wire_lifecycle
from engined.wire.errors import WireError, bound_message

if TYPE_CHECKING:
    from engined.server.exposition import MetricsRequests

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
NO_METRICS = "this daemon keeps no metrics: they are collected with http_port or api_port set"


def is_operator(frame: zmq.Frame) -> bool:
    """Whether the connection a frame came on has the operator role (the gatekeeper's say;
    a socket without a gatekeeper has no operators)."""
    try:
        return frame.get(ROLE_PROPERTY) == Role.OPERATOR
    except zmq.ZMQError:
        return False


def forbidden(what: str) -> str:
    return (
        f"{what} needs the operator role: connect to the welcome's operator_endpoint as the "
        "daemon's user, or with an operator CURVE key"
    )


def split_envelope(frames: list[bytes]) -> tuple[bytes, bool, bytes] | None:
    """(identity, REQ-style delimiter present, body), or None for a malformed envelope."""
    if len(frames) == 2:
        return frames[0], False, frames[1]
    if len(frames) == 3 and frames[1] == DELIMITER:
        return frames[0], True, frames[2]
    return None


class ControlServer:
    """Client protocol v1 over one ROUTER socket."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        loops: Sequence[RankHandle],
        *,
        welcome: Callable[[], wire.Welcome],
        settings: RuntimeSettings,
        instance_id: str | None = None,
        max_queued_requests: int,
        handoff_timeout_s: float | None = None,
        deadlines: Deadlines | None = None,
        clock: Callable[[], float] = time.monotonic,
        inflight_bytes: int = CONTROL_INFLIGHT_BYTES,
        unread_messages: int | None = None,
        unread_bytes: int = CONTROL_UNREAD_BYTES,
        metrics: MetricsRequests | None = None,
    ) -> None:
        """`deadlines` (on `clock`, the ranks' clock) are those of paced ranks in this
        event loop: a reading turn ends early once one of them is due. `inflight_bytes` is
        what one client's requests in flight may be charged (`engined.server.budgets`);
        `unread_messages` and `unread_bytes` what it may leave unread (`ClientTable`).
        `metrics` answers `metrics` (None: the daemon keeps no metrics). `instance_id` is
        the welcome's, repeated in every `pong`."""
        self._sock = sock
        self._deadlines = deadlines
        self._clock = clock
        self._loops = loops
        self._welcome = welcome
        self._instance_id = instance_id
        self._settings = settings
        # Malformed input is logged in bursts per client, not once per message.
        self._bad_log = LogThrottle()
        self._clients = ClientTable(
            sock,
            in_flight=self._in_flight,
            dropped=self._dropped,
            recovered=self._recovered,
            unread_messages=unread_messages,
            unread_bytes=unread_bytes,
        )
        self._ids = RequestIds()
        self._unnamed = itertools.count()
        self._ownership = Ownership(
            loops,
            notify=self._terminals,
            released=self._clients.settle,
            handoff_timeout_s=handoff_timeout_s,
        )
        self._load = LoadWatch(loops, self._clients.send)
        self._max_queued = max_queued_requests
        self._inflight_bytes = inflight_bytes
        self._decoder = wire.ControlDecoder()
        self._rr = itertools.cycle(range(len(loops)))
        self.shutting_down = False
        # Submits refused for a full queue (`max_queued_requests`): vLLM's admission rejections.
        self.queue_refusals = 0
        # Shutdown (close_intake): every message but hello and ping is refused, and the
        # reader reads only what is queued.
        self._closing = False
        self._closing_reads = 0
        self._closing_ends = 0.0
        self._nowait: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._reader: asyncio.Task[object] | None = None
        self._retry: asyncio.Task[None] | None = None
        self._receiving: Awaitable[list[zmq.Frame]] | None = None
        self._reports = Reports(loops)
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        # Set when a handler fails unexpectedly: a bug, which must end the daemon non-zero.
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    @property
    def owners_changed(self) -> asyncio.Event:
        """Set whenever a request stops being owned; shutdown waits on it to drain."""
        return self._ownership.owners_changed

    def client_state(self) -> dict[str, int]:
        """The sizes of everything kept per client identity (tests, benchmarks)."""
        return {
            "tracked": self._clients.tracked,
            "owning": self._ownership.clients(),
            "watching": self._load.watchers,
            "dropped": self._clients.episodes,
            "notices": self._clients.notices,
            "stalls": self._clients.stalls,
            "backlogs": len(self._clients.backlogs),
            "queued_bytes": self._clients.backlogs.bytes,
            "idle_waiting": self._reports.waiting_clients,
        }

    # --- reading ------------------------------------------------------------------------

    async def serve(self) -> None:
        """Read and dispatch client messages, yielding to the event loop between turns.

        A turn is at most CONTROL_TURN_MESSAGES messages or CONTROL_TURN_S seconds, and
        ends after the message at hand once a paced rank of this loop is due (`deadlines`):
        control traffic does not hold a due pass longer than one message. NOTE:
        while messages are queued, pyzmq's recv returns a completed future and awaiting it
        does not yield; unbounded, a burst of pings or garbage held every pass, publisher,
        signal and watchdog ping until it was drained. The ROUTER fair-queues its peers, so
        a flooder's backlog delays the flooder, not the other clients.
        """
        self._reader = asyncio.current_task()
        self._retry = retry = self._spawn(self._clients.retry_dropped())
        try:
            await self._read()
        finally:
            retry.cancel()

    async def _read(self) -> None:
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
            if self._closing:
                queued = await self._queued()
                if queued is None:
                    return
                received = queued
            else:
                self._receiving = receiving = sock.recv_multipart(copy=False)
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
                elif self._closing and not isinstance(msg, wire.Hello | wire.Ping):
                    self._error(identity, msg.id, "shutting_down", SHUTTING_DOWN)
                else:
                    self._dispatch(identity, msg, received[-1])
            self._clients.settle(identity)

    def _dispatch(self, identity: bytes, msg: wire.ClientMessage, frame: zmq.Frame) -> None:
        """Answer or start `msg`; `frame` (its body) says the sender's role, read only for
        the commands that need one."""
        match msg:
            case wire.Hello():
                welcome = self._welcome()
                welcome.id = msg.id
                self._reply(identity, welcome)
            case wire.Ping():
                self._reply(identity, wire.Pong(id=msg.id, instance_id=self._instance_id))
            case wire.Stats():
                if self._reports.live:
                    self._reply(identity, self._reports.stats(msg.id))
                else:
                    self._command(
                        identity, self._answer(identity, self._reports.fresh_stats(msg.id))
                    )
            case wire.WaitIdle():
                refusal = self._reports.admit_wait(msg, identity)
                if refusal is None:
                    waited = self._reports.until_idle(msg, identity)
                    self._command(identity, self._answer(identity, waited))
                else:
                    self._error(identity, msg.id, *refusal)
            case wire.Submit() | wire.SubmitHandoffPrefill() | wire.ReserveDestination():
                self._command(identity, self._submit(identity, msg))
            case wire.Cancel():
                self._command(identity, self._cancel(identity, msg, is_operator(frame)))
            case wire.ReleaseSource() | wire.CancelSource():
                routes = self._ownership.sources
                self._command(identity, self._handoff_command(identity, msg, routes))
            case wire.ActivateDestination() | wire.CancelDestination():
                routes = self._ownership.destinations
                self._command(identity, self._handoff_command(identity, msg, routes))
            case wire.ResetPrefixCache() | wire.SetVocabulary() | wire.SetFpmWorkerId() if (
                not is_operator(frame)
            ):
                self._error(
                    identity, msg.id, "forbidden", forbidden(str(msg.__struct_config__.tag))
                )
            case wire.ResetPrefixCache():
                self._command(identity, self._reset_prefix_cache(identity, msg))
            case wire.SetVocabulary():
                self._command(identity, self._set_vocabulary(identity, msg))
            case wire.SetFpmWorkerId():
                if msg.dp_rank is not None and msg.dp_rank >= len(self._loops):
                    self._error(
                        identity,
                        msg.id,
                        "invalid_request",
                        f"dp_rank: {msg.dp_rank} is out of range [0, {len(self._loops)})",
                    )
                else:
                    self._settings.set_fpm_worker_id(msg.worker_id, msg.dp_rank)
                    self._reply(identity, wire.Applied(id=msg.id))
            case wire.WatchLoad():
                self._reply(identity, wire.Applied(id=msg.id))
                self._load.watch(identity)
            case wire.Metrics():
                self._metrics_request(identity, msg)

    def _command(self, identity: bytes, coro: Coroutine[object, object, None]) -> None:
        """Run a handler that awaits a rank; the client's state is kept until it replies."""
        self._clients.hold(identity)
        self._spawn(coro).add_done_callback(lambda _: self._clients.release(identity))

    def _spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self.failed.done():
            self.failed.set_result(exc)

    # --- requests and commands ----------------------------------------------------------

    def _error(self, identity: bytes, msg_id: int | str | None, code: str, message: str) -> None:
        # Bounded: core messages quote ids, and nothing a client sent is echoed unbounded.
        reply = wire.ErrorReply(id=msg_id, code=code, message=bound_message(message))  # type: ignore[arg-type]
        self._reply(identity, reply)

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
            self._error(identity, msg.id, "shutting_down", SHUTTING_DOWN)
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
        engine = loop.engine
        capacity = engine.usable_blocks * engine.block_size
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
        if self._max_queued and engine.num_waiting() + loop.queued >= self._max_queued:
            self.queue_refusals += 1
            self._error(
                identity,
                msg.id,
                "overloaded",
                f"rank {rank} has {self._max_queued} queued requests",
            )
            return
        cost = request_bytes(
            len(request.token_ids),
            len(request.output_token_ids or ()),
            len(request.stop_token_ids or ()),
            len(request.cache_salt.encode()) if request.cache_salt else 0,
        )
        held = self._ownership.inflight_bytes(identity)
        if held + cost > self._inflight_bytes:
            self._error(
                identity, msg.id, "overloaded", over_budget(held, cost, self._inflight_bytes)
            )
            return
        # An unnamed request's tokens are keyed by its count, not by the UUID it is given.
        unnamed = None if request.request_id else next(self._unnamed)
        request_id = request.request_id or str(uuid.uuid4())
        command = to_core_command(msg, request_id=request_id, stream_name=unnamed)
        assert command is not None
        routes: dict[str, HandoffRoute] | None = None
        handoff_id = ""
        match msg:
            case wire.SubmitHandoffPrefill():
                routes, handoff_id = self._ownership.sources, msg.handoff_id
            case wire.ReserveDestination():
                routes, handoff_id = self._ownership.destinations, msg.handoff_id
        existing = None if routes is None else routes.get(handoff_id)
        if existing is not None:
            # The core that owns the handoff id must see the duplicate and refuse it.
            rank, loop = existing.rank, self._loops[existing.rank]
        ownership = self._ownership
        core_id = request_id
        # An alias of this client's by that name is as active as the name itself.
        aliased = self._ids.core_id(identity, request_id) != request_id
        if aliased or not ownership.claim(rank, request_id, identity, cost):
            holder = ownership.owner(rank, request_id)
            own = aliased or holder == identity
            if not isinstance(msg, wire.Submit) or holder is None or own:
                self._error(
                    identity,
                    msg.id,
                    "duplicate_request",
                    f"request {request_id} is already active",
                )
                return
            # Another client's name: this request runs under an alias (request_ids).
            core_id = self._ids.alias(identity, request_id)
            command = to_core_command(msg, request_id=core_id, stream_name=request_id)
            assert command is not None and ownership.claim(rank, core_id, identity, cost)
        new_route: HandoffRoute | None = None
        if routes is not None and existing is None:
            new_route = HandoffRoute(rank, identity, request_id)
            ownership.add_route(routes, handoff_id, new_route)
        try:
            effects = await loop.call(command)
        except CoreError as exc:
            ownership.disown(rank, core_id, identity)
            self._ids.forget(core_id)
            if routes is not None and new_route is not None and routes.get(handoff_id) is new_route:
                ownership.drop_route(routes, handoff_id)
            self._error(identity, msg.id, exc.code, str(exc))
            return
        if isinstance(effects.result, core.DestinationAccepted):
            self._reply(
                identity, wire.DestinationAccepted(id=msg.id, request_id=request_id, dp_rank=rank)
            )
        else:
            self._reply(identity, wire.Submitted(id=msg.id, request_id=request_id, dp_rank=rank))

    async def _cancel(self, identity: bytes, msg: wire.Cancel, operator: bool) -> None:
        """A client cancels its own requests, an operator anyone's; another client's
        request is answered as an unknown one (`noop`), so ids of others do not leak.

        The owner's stream ends with one `cancelled` terminal, sent before the canceller's
        `applied`, so it comes first when the owner is the canceller.
        """
        ownership = self._ownership
        request_id = self._ids.core_id(identity, msg.request_id)
        cancel = to_core_command(msgspec.structs.replace(msg, request_id=request_id))
        for rank in ownership.ranks_owning(request_id):
            if not operator and ownership.owner(rank, request_id) != identity:
                continue
            effects = await self._loops[rank].call(cancel)
            if isinstance(effects.result, core.Applied):
                self._ownership.end(rank, request_id)
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
        """From any client: a handoff id is a capability, shared by the parties of one
        handoff (Dynamo's decode worker releases the source its prefill worker registered,
        on another connection); Dynamo's are uuids, and an id nobody else can guess is
        what keeps others off (protocol §1.7)."""
        route = routes.get(msg.handoff_id)
        if route is None:
            self._reply(identity, wire.Noop(id=msg.id))
            return
        command = to_core_command(msg)
        assert command is not None
        loop = self._loops[route.rank]
        effects = await loop.call(command)
        applied = isinstance(effects.result, core.Applied)
        if applied and isinstance(msg, wire.ActivateDestination):
            route.deadline = None
        if applied and not isinstance(msg, wire.ActivateDestination):
            if routes.get(msg.handoff_id) is route:
                self._ownership.drop_route(routes, msg.handoff_id)
            self._ownership.end_ended(route.rank, effects.ended)
        self._reply(identity, wire.Applied(id=msg.id) if applied else wire.Noop(id=msg.id))

    async def expire_handoffs(self) -> None:
        """Abandon handoff sessions whose coordinator went quiet (handoff_session_timeout_ms)."""
        await self._ownership.expire_handoffs()

    async def _reset_prefix_cache(self, identity: bytes, msg: wire.ResetPrefixCache) -> None:
        ranks = range(len(self._loops)) if msg.dp_rank is None else [msg.dp_rank]
        if msg.dp_rank is not None and msg.dp_rank >= len(self._loops):
            self._error(
                identity, msg.id, "invalid_request", f"dp_rank: {msg.dp_rank} is out of range"
            )
            return
        refused = []
        reset = to_core_command(msg)
        for rank in ranks:
            effects = await self._loops[rank].call(reset)
            if not isinstance(effects.result, core.Applied):
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

    def _metrics_request(self, identity: bytes, msg: wire.Metrics) -> None:
        requests = self._metrics
        if requests is None:
            self._error(identity, msg.id, "unsupported", NO_METRICS)
            return
        refusal = requests.admit(identity)
        if refusal is not None:
            self._error(identity, msg.id, "overloaded", refusal)
            return
        self._command(identity, self._answer(identity, requests.answer(msg, identity)))

    async def _answer(
        self, identity: bytes, reply: Coroutine[object, object, wire.DaemonMessage]
    ) -> None:
        self._reply(identity, await reply)

    async def _set_vocabulary(self, identity: bytes, msg: wire.SetVocabulary) -> None:
        """Every rank or none: the cores validate alike, so only the first can refuse."""
        command = to_core_command(msg)
        for loop in self._loops:
            try:
                await loop.call(command)
            except CoreError as exc:
                self._error(identity, msg.id, exc.code, str(exc))
                return
        self._settings.vocabulary_applied(msg.vocab_size, msg.excluded_token_ids)
        self._reply(identity, wire.Applied(id=msg.id))

    def stats(self, msg_id: int | str | None = None) -> wire.StatsReply:
        return self._reports.stats(msg_id)

    # --- delivery (called by the engine loops) ------------------------------------------

    def deliver_outputs(
        self, rank: int, outputs: list[core.RequestOutput], decodes: core.Decodes
    ) -> None:
        ownership = self._ownership
        per_client, ended = route_outputs(outputs, decodes, ownership.owners_on(rank))
        for request_id in ended:
            ownership.finished(rank, request_id)
        renamed = self._ids.renamed
        for identity, entries in per_client.items():
            self._reply(identity, wire.Output(dp_rank=rank, outputs=renamed(entries)))
            self._clients.settle(identity)

    def deliver_lifecycle(self, rank: int, events: list[core.LifecycleEvent]) -> None:
        ownership = self._ownership
        per_client: dict[bytes, list[wire.WireLifecycleEvent]] = defaultdict(list)
        for event in events:
            source = isinstance(event, core.SourceHeld)
            route = (ownership.sources if source else ownership.destinations).get(event.handoff_id)
            if route is not None and route.rank == rank:
                per_client[route.identity].append(to_wire_lifecycle(event))
                if source:
                    route.deadline = ownership.handoff_deadline()
        for identity, batch in per_client.items():
            self._reply(identity, wire.Lifecycle(dp_rank=rank, events=batch))

    async def close_intake(self) -> None:
        """Shutdown, after the drain: end every request still owned (`Ownership.end_all`:
        a submit being applied is answered before its terminal), refuse every message but
        `hello` and `ping` from now on, and return once every command read before has been
        answered, so that nothing awaits the ranks any more and they may stop."""
        await self._ownership.end_all()
        self._closing = True
        handlers = [task for task in self._tasks if task is not self._retry]
        if handlers:
            await asyncio.wait(handlers)

    async def answer_queued(self) -> None:
        """Answer what clients have queued or are still sending, then stop reading (the
        ranks have stopped). ZeroMQ discards a closed socket's queue: unread, a flood's
        submits got no reply at all. Reading ends once the socket has been quiet for
        CLOSE_QUIET_S (at once when nothing came since intake closed), after CLOSE_READ_S,
        or at CLOSE_READ_MESSAGES since intake closed; what arrives later is never read."""
        reader, receiving = self._reader, self._receiving
        if reader is not None and not reader.done():
            if isinstance(receiving, asyncio.Future) and not receiving.done():
                reader.cancel()  # it has taken no message: cancelling loses none
            await asyncio.wait([reader])
        self._closing = True
        self._closing_ends = time.monotonic() + CLOSE_READ_S
        await self._read()
        log.info("control socket drained", answered_while_closing=self._closing_reads)

    async def _queued(self) -> list[zmq.Frame] | None:
        """The next message while closing, if one comes in time (`answer_queued`)."""
        while self._closing_reads < CLOSE_READ_MESSAGES:
            try:
                frames = self._nowait.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = min(self._closing_ends - time.monotonic(), CLOSE_QUIET_S)
                if not self._closing_reads or left <= 0:
                    return None
                if not await self._sock.poll(left * 1000):
                    return None
                continue
            self._closing_reads += 1
            return frames
        return None

    def owned_requests(self) -> int:
        return self._ownership.owned_requests()

    # --- clients ------------------------------------------------------------------------

    def _terminals(self, identity: bytes, rank: int, request_ids: list[str]) -> None:
        """Ownership's word that requests ended early: their `cancelled` terminals, under
        the names their owner gave them."""
        if self._ids:
            names = []
            for request_id in request_ids:
                names.append(self._ids.client_id(request_id))
                self._ids.forget(request_id)
            request_ids = names
        self._clients.send_terminals(identity, rank, request_ids)

    def _reply(self, identity: bytes, msg: wire.DaemonMessage) -> None:
        self._clients.send(identity, msg)

    def _in_flight(self, identity: bytes) -> bool:
        return self._ownership.holds(identity) or self._load.watching(identity)

    def _dropped(self, identity: bytes, episode: Episode) -> None:
        """A client cannot be written to: end what it owns, once; its terminals are kept."""
        episode.watching = self._load.forget(identity)
        episode.cancelled = self._ownership.end_client(identity)

    def _recovered(self, identity: bytes, episode: Episode) -> None:
        if episode.watching:
            self._load.watch(identity)
