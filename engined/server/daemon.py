"""Start-up, serving and shutdown of the daemon: one asyncio loop, its ranks placed by a
layout (`engined.server.ranks.rank_layouts`: in this loop, or in worker processes, where a worker
that dies ends the daemon non-zero); the control ROUTER and this lifecycle are the same.

`Daemon.serve()` reads as the lifecycle: start up (bind every socket, or fail with
STARTUP_FAILURE), serve until a signal or a fatal error, shut down. Shutdown stops taking new
requests, lets in-flight ones finish for up to `drain_timeout` seconds, ends the rest as
`cancelled`, and closes every socket; a second signal skips the drain. A bug in a rank or a
handler ends the process non-zero, so a supervisor restarts it instead of it serving half
dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.asyncio

from engined import event_loop
from engined.config import DaemonConfig
from engined.logs import configure_logging
from engined.server.api_servers import ApiServers
from engined.server.control.control_server import ControlServer
from engined.server.control.control_socket import CONTROL_HWM, bind_control
from engined.server.control.settings import RuntimeSettings
from engined.server.control.welcome import welcome_message
from engined.server.ops.heap import trim_when_idle
from engined.server.ops.startup_log import log_started
from engined.server.ops.systemd import (
    AnyNotifier,
    Notifier,
    NullNotifier,
    StatusLine,
    keepalive,
    watchdog_interval,
)
from engined.server.ranks.collector import Collector, YoungGeneration
from engined.server.ranks.rank_build import start_collection
from engined.server.ranks.rank_handle import RankHandle
from engined.server.ranks.rank_layouts import RankLayout, rank_layout
from engined.server.ranks.rank_process import RankWorkerDied, WorkerProcess
from engined.server.ranks.realtime import enter_realtime
from engined.server.security.access import AccessError, gate_policy
from engined.server.security.gatekeeper import Gatekeeper
from engined.zmq_sockets import SocketRegistry

if TYPE_CHECKING:
    from engined.server.observability import Observability
    from engined.server.ops.http_endpoint import HealthState
    from engined.server.ops.prometheus_metrics import VllmMetrics

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
STARTUP_FAILURE = 3


class Daemon:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        on_ready: Callable[[Daemon], None] | None = None,
        notifier: AnyNotifier | None = None,
        watchdog_s: float | None = None,
        rank_processes: int | None = None,
    ) -> None:
        """`rank_processes` (default: the config's): 0 runs every rank in this process's
        event loop; N >= 1 runs them in min(N, dp_size) worker processes, in contiguous
        blocks of ranks; AUTO_RANK_PROCESSES (-1) in one per core this process may run on,
        at most dp_size (`auto_rank_processes`)."""
        self.config = config
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # Unguessable, so that no client can take another start for this one (protocol §1.1).
        self.instance_id = secrets.token_hex(16)
        self.ranks: RankLayout = rank_layout(
            config, rank_processes, worker_id=self.worker_id, watchdog_s=watchdog_s
        )
        self.rank_processes = self.ranks.processes
        self._worker_died = False
        self.control: ControlServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._registry: SocketRegistry | None = None
        # The ZAP handler of every socket bound here (engined.server.security.gatekeeper).
        self.gate: Gatekeeper | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._force = False
        self._on_ready = on_ready
        # systemd: READY/STATUS/WATCHDOG/STOPPING (engined.server.ops.systemd); a no-op outside it.
        self._notifier = notifier or NullNotifier()
        self._watchdog_s = watchdog_s
        self._status = StatusLine()
        self.started = False
        # The metrics, /metrics and /health, when `http_port` or `api_port` is set.
        self.observability: Observability | None = None
        # The OpenAI API server processes (engined.server.api_servers), unless api_port is "".
        self.api = None if config.api_port is None else ApiServers(config)
        self._collection: Collector | YoungGeneration | None = None

    # --- lifecycle ----------------------------------------------------------------------

    async def serve(self) -> int:
        try:
            await self.startup()
        except (zmq.ZMQError, OSError, AccessError) as exc:
            log.error("startup failed", error=str(exc))
            await self.close()
            return STARTUP_FAILURE
        code = await self.main_loop()
        await self.shutdown(drain=code == EXIT_OK)
        # A worker that died while the daemon drained still ends it non-zero.
        return EXIT_FAILURE if self._worker_died else code

    async def startup(self) -> None:
        """Bind and start everything, in an order where nothing waits for a collaborator
        built later: /metrics and /health first (503 while the rest starts), the control
        socket and its server, then the ranks (`rank_layouts`), which deliver to that
        server, then the server's routing for them, then the tasks that serve."""
        cfg = self.config
        engine = cfg.engine
        if cfg.realtime_priority:
            # First: every thread and process started from here on inherits it.
            enter_realtime(cfg.realtime_priority)
        if cfg.http_port is not None or cfg.api_port is not None:
            # Imported here: prometheus_client adds ~20 ms to a start-up without metrics.
            from engined.server.observability import Observability

            # First, so that /health answers 503 while the rest starts.
            self.observability = Observability(cfg, self.ranks.handles)
            if cfg.http_port is not None:
                await self.observability.serve_http(cfg, self.health)
        self._ctx = ctx = zmq.asyncio.Context()
        self.gate = gate = Gatekeeper(ctx, gate_policy(cfg))
        self._registry = registry = SocketRegistry()
        control_sock, operator, max_message_bytes = bind_control(ctx, registry, gate, cfg)
        ranks = self.ranks
        settings = RuntimeSettings(
            vocab_size=engine.vocab_size,
            excluded_token_ids=engine.excluded_token_ids,
            fpm_worker_id=self.worker_id,
            fpm=ranks.fpm_sinks,
        )
        control = ControlServer(
            control_sock,
            welcome=partial(
                welcome_message,
                cfg,
                ranks.endpoints,
                settings,
                operator.advertised,
                self.instance_id,
            ),
            instance_id=self.instance_id,
            settings=settings,
            max_queued_requests=cfg.max_queued_requests,
            handoff_timeout_s=engine.handoff_session_timeout_ms / 1000.0,
            deadlines=None if ranks.pacing is None else ranks.pacing.deadlines,
            inflight_bytes=cfg.control_inflight_bytes,
            unread_messages=CONTROL_HWM,
            unread_bytes=cfg.control_unread_bytes,
            metrics=None if self.observability is None else self.observability.requests,
            lifecycle_observer=None if self.metrics is None else self.metrics.on_lifecycle,
        )
        await ranks.start(ctx, registry, gate, control)
        if self.observability is not None:
            api = None if self.api is None else self.api.counters
            self.observability.watch(ranks.handles, ranks.watched_publishers, control, api)
        obs = self.observability
        control.attach(ranks.handles, None if obs is None else obs.sleep_operations.record)
        self.control = control
        self._tasks.append(asyncio.create_task(control.serve(), name="control"))
        self._tasks.append(asyncio.create_task(control.expire_handoffs(), name="handoff-timeouts"))
        work = trim_when_idle(
            self._idle, lambda: sum(loop.gauges().tokens_total for loop in self.loops)
        )
        self._tasks.append(asyncio.create_task(work, name="heap-trim"))
        for name, run_ranks in ranks.tasks():
            self._tasks.append(asyncio.create_task(run_ranks, name=name))
        if self.api is not None:
            await self.api.start()
            self._tasks.append(asyncio.create_task(self.api.watch(), name="api-servers"))
        self.started = True
        self._collection = start_collection(ranks.model_clock, ranks.pacing)
        log_started(
            cfg,
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            ranks=ranks,
            max_message_bytes=max_message_bytes,
            api_port=None if self.api is None else self.api.port,
        )
        self._notifier.ready(status=self._status_line())
        if self._notifier.enabled:
            status = keepalive(
                self._notifier,
                self._status_line,
                watchdog_s=self._watchdog_s,
                healthy=self.workers_healthy if self.workers else None,
            )
            self._tasks.append(asyncio.create_task(status, name="systemd"))
        if self._on_ready is not None:
            self._on_ready(self)

    @property
    def metrics(self) -> VllmMetrics | None:
        return None if self.observability is None else self.observability.metrics

    @property
    def loops(self) -> list[RankHandle]:
        """Rank r's handle at index r (empty until start-up has started the ranks)."""
        return self.ranks.handles

    @property
    def workers(self) -> list[WorkerProcess]:
        """The rank worker processes (none when the ranks run in this event loop)."""
        return self.ranks.workers

    def workers_healthy(self) -> bool:
        """Whether every rank worker was heard from within a watchdog ping interval: the
        systemd watchdog is pinged only then, so a stuck worker gets the daemon restarted."""
        silence = self._watchdog_s if self._watchdog_s is not None else math.inf
        return self.ranks.healthy(silence)

    def _worker_failed(self) -> bool:
        return any(
            task.done() and not task.cancelled() and task.exception() is not None
            for task in self._tasks
            if task.get_name().startswith("rank-worker-")
        )

    async def main_loop(self) -> int:
        """Serve until asked to stop (EXIT_OK) or until a task fails (EXIT_FAILURE)."""
        assert self.control is not None
        stop = asyncio.ensure_future(self._stop.wait())
        failed = self.control.failed
        watched: set[asyncio.Future[object]] = {stop, failed, *self._tasks}  # type: ignore[arg-type]
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if stop in done:
            return EXIT_OK
        stop.cancel()
        for task in done:
            if task is failed:
                exc = failed.result()
            elif task.cancelled():
                continue
            else:
                exc = task.exception()  # type: ignore[assignment]
            log.error("fatal error", exc_info=exc)
        return EXIT_FAILURE

    def health(self) -> HealthState:
        """What /health reports: 503 until every socket is up, and again once draining starts."""
        if self.control is not None and self.control.shutting_down:
            return "draining"
        return "serving" if self.started else "starting"

    def _idle(self) -> bool:
        """No request in flight and no state kept for any client."""
        control = self.control
        return (
            control is not None
            and not control.owned_requests()
            and not any(control.client_state().values())
        )

    def handle_exit(self, sig: int | None = None) -> None:
        """First signal: graceful shutdown. Second: skip the drain."""
        if self._stop.is_set():
            self._force = True
            if self.control is not None:
                self.control.owners_changed.set()
        self._stop.set()
        log.info("shutdown requested", signal=sig, force=self._force)

    async def shutdown(self, *, drain: bool = True) -> None:
        """Every message the control socket read is answered, and every `submitted` is
        followed by its terminal: intake closes before the ranks stop, and what is queued
        at the socket is answered before it closes."""
        control = self.control
        if self.api is not None:
            # First, so that they stop accepting and finish their streams while we drain.
            self.api.stop()
        if control is not None:
            control.shutting_down = True
            self._notifier.stopping(status=self._status_line())
            if drain:
                await self._drain(control)
            await self._unless_a_rank_ends(control.close_intake())
        for loop in self.loops:
            loop.stop()
        for task in self._rank_tasks():
            if not task.done():
                # A worker that died is logged by its run() and counted below.
                with contextlib.suppress(TimeoutError, RankWorkerDied):
                    await asyncio.wait_for(asyncio.shield(task), 1.0)
        if control is not None:
            await control.answer_queued()
        self._worker_died = self._worker_failed()
        await self.close()
        log.info("engined stopped")

    def _rank_tasks(self) -> list[asyncio.Task[None]]:
        return [task for task in self._tasks if task.get_name().startswith("rank-")]

    async def _unless_a_rank_ends(self, step: Coroutine[object, object, None]) -> None:
        """Await `step`, which needs the ranks, unless one ends first: a rank worker that
        died answers nothing, and the daemon must still exit."""
        task = asyncio.ensure_future(step)
        await asyncio.wait([task, *self._rank_tasks()], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        else:
            task.cancel()
            await asyncio.wait([task])

    async def _drain(self, control: ControlServer) -> None:
        deadline = time.monotonic() + self.config.drain_timeout
        pending = control.owned_requests()
        if pending:
            log.info("draining", requests=pending, timeout_s=self.config.drain_timeout)
        while control.owned_requests() and not self._force and not self._worker_failed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("drain timeout", cancelling=control.owned_requests())
                return
            control.owners_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(control.owners_changed.wait(), remaining)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.api is not None:
            await self.api.close()
        if self.observability is not None:
            await self.observability.close()
        await self.ranks.close()
        if self._registry is not None:
            self._registry.close()
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._notifier.close()
        if self._collection is not None:
            self._collection.close()

    def _status_line(self) -> str:
        stopping = self.control is not None and self.control.shutting_down
        return self._status([loop.gauges() for loop in self.loops], stopping=stopping)


async def _serve(config: DaemonConfig) -> int:
    daemon = Daemon(
        config,
        notifier=Notifier.from_env(os.environ),
        watchdog_s=watchdog_interval(os.environ),
    )
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, daemon.handle_exit, sig)
    try:
        return await daemon.serve()
    finally:
        # Only the interpreter's exit is left: a signal now (a supervisor's second SIGTERM)
        # must not make the exit a death by signal (-15, seen in test_fairness). Removing the
        # loop's handler restores the default action until SIG_IGN, hence the block meanwhile.
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        for sig in signals:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def run(config: DaemonConfig) -> int:
    """Run the daemon in the foreground; returns the process exit code."""
    configure_logging(config.log_format, config.log_level)
    return event_loop.run(_serve(config))
