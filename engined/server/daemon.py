"""Start-up, serving and shutdown of the daemon: one asyncio loop, one EngineLoop per rank.

With `rank_processes` N >= 1 the ranks run in N worker processes instead
(`engined.server.rank_worker`), seen here through `RankProxy`s; the control ROUTER, the
protocol and this lifecycle are the same, and a worker that dies ends the daemon non-zero.

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
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.asyncio

import engined
from engined.config import DaemonConfig
from engined.core import running as running_core
from engined.logs import configure_logging
from engined.server.access import AccessError, gate_policy, operator_endpoint
from engined.server.budgets import control_max_message_bytes
from engined.server.collector import Collector, YoungGeneration
from engined.server.control import ControlServer
from engined.server.gatekeeper import Domain, Gatekeeper
from engined.server.heap import trim_when_idle
from engined.server.rank_handle import RankHandle
from engined.server.rank_layouts import RankLayout, rank_layout
from engined.server.rank_process import RankWorkerDied, WorkerProcess, available_cores
from engined.server.ranks import start_collection
from engined.server.realtime import enter_realtime
from engined.server.reports import Refresh
from engined.server.settings import RuntimeSettings
from engined.server.startup_log import engine_summary, limits
from engined.server.systemd import AnyNotifier, Notifier, NullNotifier, keepalive, watchdog_interval
from engined.server.welcome import welcome_message
from engined.zmq_sockets import SocketRegistry

if TYPE_CHECKING:
    from engined.server.api_servers import ApiServers
    from engined.server.exposition import Exposition, MetricsRequests
    from engined.server.http import HealthState, HttpServer
    from engined.server.metrics import VllmMetrics

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
STARTUP_FAILURE = 3
# Messages one control client may leave unread (its ZeroMQ pipe and its backlog together),
# and the pipe's own size: small, so that what it holds beyond the backlog's counted bytes
# stays small too (256 of the largest `welcome`, 41 KB, are 10.5 MB).
CONTROL_HWM = 100_000
CONTROL_PIPE_HWM = 256
# `rank_processes`: one worker process per available core (at most one per rank).
AUTO_RANK_PROCESSES = -1


def auto_rank_processes(dp_size: int, cores: int) -> int:
    """AUTO_RANK_PROCESSES resolved: a process per core, at most one per rank; none (the
    daemon's own loop) for a single rank or a single core, where a worker only adds a hop."""
    if dp_size == 1 or cores == 1:
        return 0
    return min(dp_size, cores)


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
        if rank_processes is None:
            rank_processes = config.rank_processes
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        if rank_processes < 0:
            rank_processes = auto_rank_processes(config.engine.dp_size, available_cores())
        self.rank_processes = rank_processes
        self.ranks: RankLayout = rank_layout(
            config, rank_processes, worker_id=self.worker_id, watchdog_s=watchdog_s
        )
        self._worker_died = False
        self.control: ControlServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._registry: SocketRegistry | None = None
        # The ZAP handler of every socket bound here (engined.server.gatekeeper).
        self.gate: Gatekeeper | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._force = False
        self._on_ready = on_ready
        # systemd: READY/STATUS/WATCHDOG/STOPPING (engined.server.systemd); a no-op outside it.
        self._notifier = notifier or NullNotifier()
        self._watchdog_s = watchdog_s
        self._status_tokens = 0
        self._status_at = time.monotonic()
        self.started = False
        # Prometheus /metrics and /health (engined.server.http), when `http_port` is set.
        self.metrics: VllmMetrics | None = None
        self.exposition: Exposition | None = None
        self._metrics_requests: MetricsRequests | None = None
        self.http: HttpServer | None = None
        # The OpenAI API server processes (engined.server.api_servers), unless api_port is "".
        self.api: ApiServers | None = None
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
        await self._start_http()
        self._ctx = ctx = zmq.asyncio.Context()
        self.gate = gate = Gatekeeper(ctx, gate_policy(cfg))
        self._registry = registry = SocketRegistry()
        max_message_bytes = control_max_message_bytes(engine)
        # NOTE: every bind goes through the registry, which refuses an ipc:// path a live
        # socket owns (libzmq would silently take it over) and claims it (sockets.IpcClaim).
        control_sock = registry.make(
            ctx,
            zmq.ROUTER,
            cfg.control_endpoint,
            bind=True,
            sndhwm=CONTROL_PIPE_HWM,
            rcvhwm=CONTROL_HWM,
            linger=1000,
            maxmsgsize=max_message_bytes,
            router_mandatory=True,
            **gate.options(Domain.CONTROL),
        )
        operator = operator_endpoint(cfg)
        if operator.bind is not None:
            registry.bind_also(control_sock, operator.bind)
        ranks = self.ranks
        settings = RuntimeSettings(
            vocab_size=engine.vocab_size,
            excluded_token_ids=engine.excluded_token_ids,
            fpm_worker_id=self.worker_id,
            fpm=ranks.fpm_sinks,
        )
        metrics = self.metrics
        control = ControlServer(
            control_sock,
            welcome=partial(welcome_message, cfg, ranks.endpoints, settings, operator.advertised),
            settings=settings,
            max_queued_requests=cfg.max_queued_requests,
            handoff_timeout_s=engine.handoff_session_timeout_ms / 1000.0,
            deadlines=None if ranks.pacing is None else ranks.pacing.deadlines,
            inflight_bytes=cfg.control_inflight_bytes,
            unread_messages=CONTROL_HWM,
            unread_bytes=cfg.control_unread_bytes,
            metrics=self._metrics_requests,
            lifecycle_observer=None if metrics is None else metrics.on_lifecycle,
        )
        await ranks.start(ctx, registry, gate, control)
        if metrics is not None:
            for loop in ranks.handles:
                metrics.attach(loop)
            metrics.watch_publishers(ranks.watched_publishers)
            metrics.watch_queue_refusals(lambda: control.queue_refusals)
        control.attach(ranks.handles)
        self.control = control
        self._tasks.append(asyncio.create_task(control.serve(), name="control"))
        self._tasks.append(asyncio.create_task(control.expire_handoffs(), name="handoff-timeouts"))
        work = trim_when_idle(
            self._idle, lambda: sum(loop.gauges().tokens_total for loop in self.loops)
        )
        self._tasks.append(asyncio.create_task(work, name="heap-trim"))
        for name, run_ranks in ranks.tasks():
            self._tasks.append(asyncio.create_task(run_ranks, name=name))
        if cfg.api_port is not None:
            from engined.server.api_servers import ApiServers

            self.api = ApiServers(cfg)
            await self.api.start()
            self._tasks.append(asyncio.create_task(self.api.watch(), name="api-servers"))
        self.started = True
        self._collection = start_collection(cfg, ranks.pacing)
        log.info(
            "engined started",
            version=engined.__version__,
            core=str(running_core()),
            pid=os.getpid(),
            worker_id=self.worker_id,
            control_endpoint=cfg.control_endpoint,
            kv_events_endpoints=ranks.endpoints.kv_events,
            kv_replay_endpoints=ranks.endpoints.kv_replay,
            fpm_endpoints=ranks.endpoints.fpm,
            engine=engine_summary(cfg),
            limits=limits(cfg, ranks.limits.hwms, ranks.limits.batch_bytes, max_message_bytes),
            rank_processes=[worker.pid for worker in self.workers],
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

    async def _start_http(self) -> None:
        """The metrics, and /metrics and /health when `http_port` is set."""
        cfg = self.config
        if cfg.http_port is not None or cfg.api_port is not None:
            # Imported here: prometheus_client adds ~20 ms to start-up, which a daemon without
            # metrics (no /metrics, no API server) should not pay.
            from engined.server.build_info import BuildInfo
            from engined.server.exposition import Exposition, MetricsRequests
            from engined.server.metrics import VllmMetrics

            self.metrics = VllmMetrics.from_config(cfg)
            info = BuildInfo(cfg.model_name, engined.__version__, running_core())
            self.metrics.register(info)
            # One exposition for /metrics and the control protocol's `metrics` command.
            self.exposition = Exposition(
                self.metrics.registry, Refresh(self.ranks.handles), rendered=self.metrics
            )
            self._metrics_requests = MetricsRequests(self.exposition)
        if cfg.http_port is not None:
            from engined.server.http import HttpServer

            assert self.exposition is not None
            # Bound first, so that /health answers 503 while the rest starts.
            self.http = HttpServer(
                self.exposition,
                health=self.health,
                api_keys=cfg.api_key or (),
                guard_metrics=cfg.api_key_metrics,
            )
            await self.http.start(cfg.http_host, cfg.http_port)

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
        if self.http is not None:
            await self.http.close()
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
        """systemd's STATUS=, one line: load, and output tokens/s since the previous line."""
        now = time.monotonic()
        gauges = [loop.gauges() for loop in self.loops]
        tokens = sum(g.tokens_total for g in gauges)
        rate = (tokens - self._status_tokens) / max(now - self._status_at, 1e-6)
        self._status_tokens, self._status_at = tokens, now
        metrics = [g.metrics for g in gauges]
        line = (
            f"{len(self.loops)} ranks, {sum(m.running for m in metrics)} running, "
            f"{sum(m.waiting for m in metrics)} waiting, {rate:.0f} tokens/s"
        )
        return f"stopping: {line}" if self.control and self.control.shutting_down else line


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
        # The daemon has shut down and only the interpreter's exit is left: a signal now
        # (a supervisor's second SIGTERM, say) must not turn its exit code into a death by
        # signal, as restoring the default action did (-15, seen in test_fairness).
        for sig in signals:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)


def run(config: DaemonConfig) -> int:
    """Run the daemon in the foreground; returns the process exit code."""
    configure_logging(config.log_format, config.log_level)
    return asyncio.run(_serve(config))
