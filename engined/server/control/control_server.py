"""The control ROUTER: decode and validate client messages, dispatch them to ranks, and
route every reply, output and lifecycle event back to the client that owns it.

Ownership (`engined.server.control.ownership`) is explicit: a request belongs to the identity that
submitted it, a handoff to the identity that registered it (per side: source or
destination), and every way a request ends early goes through one place that tells the
owner exactly once. Outputs of one pass are grouped per client, one `output` message each.
Sends never block the engine (`engined.server.control.clients`): a client that is gone or does not
read is dropped, its requests are cancelled and their KV freed, and it is told what happened
once it reads again.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.asyncio

from engined.config.schema import CONTROL_INFLIGHT_BYTES, CONTROL_UNREAD_BYTES
from engined.core import types as core
from engined.server.control.clients import ClientTable
from engined.server.control.control_reader import SHUTTING_DOWN, ControlReader
from engined.server.control.episodes import Episode
from engined.server.control.load import LoadWatch
from engined.server.control.ownership import Ownership
from engined.server.control.pauses import PAUSE_MESSAGES, Pauses, RecordOperation
from engined.server.control.rank_commands import RankCommands
from engined.server.control.reports import Reports
from engined.server.control.request_ids import RequestIds
from engined.server.control.settings import RuntimeSettings
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_handle import RankHandle
from engined.server.security.gatekeeper import forbidden, is_operator
from engined.wire import control as wire
from engined.wire.convert import to_wire_lifecycle
from engined.wire.output_bytes import OutputWriter
from engined.wire.protocol_errors import bound_message

if TYPE_CHECKING:
    from engined.server.ops.exposition import MetricsRequests

log = structlog.get_logger(__name__)

NO_METRICS = "this daemon keeps no metrics: they are collected with http_port or api_port set"


class ControlServer:
    """Client protocol v1 over one ROUTER socket."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
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
        lifecycle_observer: Callable[[int, list[core.LifecycleEvent]], None] | None = None,
    ) -> None:
        """Built before the ranks, which deliver to it: `attach` gives it their handles,
        before `serve`. `deadlines` (on `clock`, the ranks' clock) are those of paced ranks
        in this event loop: a reading turn ends early once one of them is due.
        `inflight_bytes` is what one client's requests in flight may be charged
        (`engined.server.control.budgets`); `unread_messages` and `unread_bytes` what it may leave
        unread (`ClientTable`). `metrics` answers `metrics` (None: the daemon keeps no
        metrics); `lifecycle_observer` sees every lifecycle event delivered (the metrics
        count a destination's transferred tokens). `instance_id` is the welcome's, repeated
        in every `pong`."""
        self._welcome = welcome
        self._instance_id = instance_id
        self._lifecycle_observer = lifecycle_observer
        self._handoff_timeout_s = handoff_timeout_s
        self._settings = settings
        self._clients = ClientTable(
            sock,
            in_flight=self._in_flight,
            dropped=self._dropped,
            recovered=self._recovered,
            unread_messages=unread_messages,
            unread_bytes=unread_bytes,
        )
        self._ids = RequestIds()
        self._outputs = OutputWriter(self._ids.client_id)
        self._max_queued = max_queued_requests
        self._inflight_bytes = inflight_bytes
        self.shutting_down = False
        self._reader = ControlReader(
            sock,
            self._clients,
            dispatch=self._dispatch,
            error=self._error,
            deadlines=deadlines,
            clock=clock,
        )
        self._reading: asyncio.Task[object] | None = None
        self._retry: asyncio.Task[None] | None = None
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        # Set when a handler fails unexpectedly: a bug, which must end the daemon non-zero.
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        # The ranks' side, from `attach`.
        self._loops: Sequence[RankHandle] = ()
        self._ownership: Ownership
        self._load: LoadWatch
        self._reports: Reports
        self._commands: RankCommands
        self._pauses: Pauses

    def attach(self, loops: Sequence[RankHandle], record: RecordOperation | None = None) -> None:
        """Route for these ranks (rank r at index r); once, before `serve`. `record` times
        the sleep-mode operations (engined.server.control.pauses)."""
        assert not self._loops, "attached twice"
        self._loops = loops
        self._ownership = Ownership(
            loops,
            notify=self._terminals,
            released=self._clients.settle,
            handoff_timeout_s=self._handoff_timeout_s,
        )
        self._load = LoadWatch(loops, self._clients.send)
        self._reports = Reports(loops, self._settings.weight_versions)
        self._pauses = Pauses(
            loops,
            ownership=self._ownership,
            reports=self._reports,
            reply=self._reply,
            error=self._error,
            record=record,
        )
        self._commands = RankCommands(
            loops,
            ownership=self._ownership,
            ids=self._ids,
            settings=self._settings,
            reply=self._reply,
            error=self._error,
            max_queued_requests=self._max_queued,
            inflight_bytes=self._inflight_bytes,
            rejecting=self._pauses.rejecting,
        )

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
            "pause_waiting": self._pauses.waiting_clients,
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
        self._reading = asyncio.current_task()
        self._retry = retry = self._spawn(self._clients.retry_dropped())
        try:
            await self._reader.read()
        finally:
            retry.cancel()

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
                self._command(identity, self._answer(identity, self._reports.fresh_stats(msg.id)))
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
                self._command(identity, self._commands.cancel(identity, msg, is_operator(frame)))
            case wire.ReleaseSource() | wire.CancelSource():
                routes = self._ownership.sources
                self._command(identity, self._commands.handoff(identity, msg, routes))
            case wire.ActivateDestination() | wire.CancelDestination():
                routes = self._ownership.destinations
                self._command(identity, self._commands.handoff(identity, msg, routes))
            case _ if isinstance(msg, wire.OPERATOR_ONLY) and not is_operator(frame):
                self._error(
                    identity, msg.id, "forbidden", forbidden(str(msg.__struct_config__.tag))
                )
            case _ if isinstance(msg, PAUSE_MESSAGES):
                refusal = self._pauses.admit(identity, msg)
                if refusal is None:
                    self._command(identity, self._pauses.apply(identity, msg))
                else:
                    self._error(identity, msg.id, *refusal)
            case wire.ResetPrefixCache():
                self._command(identity, self._commands.reset_prefix_cache(identity, msg))
            case wire.SetVocabulary():
                self._command(identity, self._commands.set_vocabulary(identity, msg))
            case wire.SetFpmWorkerId():
                self._commands.set_fpm_worker_id(identity, msg)
            case wire.SetWeightVersion():
                self._command(identity, self._commands.set_weight_version(identity, msg))
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

    async def _submit(
        self,
        identity: bytes,
        msg: wire.Submit | wire.SubmitHandoffPrefill | wire.ReserveDestination,
    ) -> None:
        if self.shutting_down:
            self._error(identity, msg.id, "shutting_down", SHUTTING_DOWN)
        else:
            await self._commands.submit(identity, msg)

    @property
    def queue_refusals(self) -> int:
        """Submits refused for a full queue (`max_queued_requests`): vLLM's admission
        rejections."""
        return self._commands.queue_refusals if self._loops else 0

    async def expire_handoffs(self) -> None:
        """Abandon handoff sessions whose coordinator went quiet (handoff_session_timeout_ms)."""
        await self._ownership.expire_handoffs()

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

    def stats(self, msg_id: int | str | None = None) -> wire.StatsReply:
        return self._reports.stats(msg_id)

    # --- delivery (called by the engine loops) ------------------------------------------

    def deliver_outputs(
        self, rank: int, outputs: list[core.RequestOutput], decodes: core.Decodes
    ) -> None:
        ownership, ids = self._ownership, self._ids
        version = self._settings.weight_versions.get(rank)
        owners = ownership.owners_on(rank)
        messages, ended = self._outputs.route(outputs, decodes, owners, rank, version)
        for request_id in ended:
            ownership.finished(rank, request_id)
            if ids:
                ids.forget(request_id)
        for identity, body in messages.items():
            self._clients.send_encoded(identity, body)
            self._clients.settle(identity)

    def deliver_lifecycle(self, rank: int, events: list[core.LifecycleEvent]) -> None:
        if self._lifecycle_observer is not None:
            self._lifecycle_observer(rank, events)
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
        self._pauses.close()
        self._reader.closing = True
        handlers = [task for task in self._tasks if task is not self._retry]
        if handlers:
            await asyncio.wait(handlers)

    async def answer_queued(self) -> None:
        """Answer what clients have queued or are still sending, then stop reading (the
        ranks have stopped). ZeroMQ discards a closed socket's queue: unread, a flood's
        submits got no reply at all (`ControlReader.read_queued`)."""
        reading, receiving = self._reading, self._reader.receiving
        if reading is not None and not reading.done():
            if isinstance(receiving, asyncio.Future) and not receiving.done():
                reading.cancel()  # it has taken no message: cancelling loses none
            await asyncio.wait([reading])
        await self._reader.read_queued()

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
