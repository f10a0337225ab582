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
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.asyncio

import engined
from engined.config import DaemonConfig
from engined.core import running as running_core
from engined.core.policy import context_length
from engined.core.types import Decodes, LifecycleEvent, RequestOutput
from engined.logs import configure_logging
from engined.server.access import AccessError, gate_policy, operator_endpoint
from engined.server.budgets import control_max_message_bytes
from engined.server.collector import Collector, YoungGeneration
from engined.server.control import ControlServer
from engined.server.gatekeeper import Domain, Gatekeeper
from engined.server.heap import trim_when_idle
from engined.server.kv_publisher import AnyKvPublisher, max_batch_bytes
from engined.server.rank_handle import RankHandle
from engined.server.rank_process import (
    RankWorkerDied,
    RankWorkerId,
    WorkerProcess,
    available_cores,
    split_ranks,
)
from engined.server.ranks import Pacing, build_rank, shared_pacing, start_collection
from engined.server.realtime import enter_realtime
from engined.server.reports import Refresh
from engined.server.settings import RuntimeSettings, WorkerIdSink
from engined.server.startup_log import engine_summary, limits
from engined.server.systemd import AnyNotifier, Notifier, NullNotifier, keepalive, watchdog_interval
from engined.wire import control as wire
from engined.zmq_sockets import SocketRegistry

if TYPE_CHECKING:
    from engined.server.api_servers import ApiServers
    from engined.server.exposition import Exposition, MetricsRequests
    from engined.server.http import HealthState, HttpServer
    from engined.server.metrics import VllmMetrics
    from engined.server.rank_proxy import RankProxy

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
STARTUP_FAILURE = 3
# Messages one control client may leave unread (its ZeroMQ pipe and its backlog together),
# and the pipe's own size: small, so that what it holds beyond the backlog's counted bytes
# stays small too (256 of the largest `welcome`, 41 KB, are 10.5 MB).
CONTROL_HWM = 100_000
CONTROL_PIPE_HWM = 256
# A rank worker's heartbeat period (seconds), shorter under a systemd watchdog (see startup).
WORKER_HEARTBEAT_S = 1.0
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
        # Unguessable, so that no client can take another start for this one (protocol §1.1).
        self.instance_id = secrets.token_hex(16)
        self.loops: list[RankHandle] = []
        # In worker mode, the same ranks as their proxies (their gauges, publisher figures).
        self._proxies: list[RankProxy] = []
        if rank_processes < 0:
            rank_processes = auto_rank_processes(config.engine.dp_size, available_cores())
        self.rank_processes = rank_processes
        self.workers: list[WorkerProcess] = []
        self._worker_dir: str | None = None
        self._worker_died = False
        self.control: ControlServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._registry: SocketRegistry | None = None
        # The ZAP handler of every socket bound here (engined.server.gatekeeper).
        self.gate: Gatekeeper | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._publishers: list[AnyKvPublisher] = []
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
        # What paced in-process ranks share: deadlines, garbage collection between passes.
        self.pacing: Pacing | None = None
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
        cfg = self.config
        engine = cfg.engine
        if cfg.realtime_priority:
            # First: every thread and process started from here on inherits it.
            enter_realtime(cfg.realtime_priority)
        if cfg.http_port is not None or cfg.api_port is not None:
            # Imported here: prometheus_client adds ~20 ms to start-up, which a daemon without
            # metrics (no /metrics, no API server) should not pay.
            from engined.server.build_info import BuildInfo
            from engined.server.exposition import Exposition, MetricsRequests
            from engined.server.http import HttpServer
            from engined.server.metrics import VllmMetrics

            # Bound first, so that /health answers 503 while the rest starts.
            self.metrics = VllmMetrics.from_config(cfg)
            info = BuildInfo(cfg.model_name, engined.__version__, running_core())
            self.metrics.register(info)
            # One exposition for /metrics and the control protocol's `metrics` command.
            self.exposition = Exposition(
                self.metrics.registry, Refresh(self.loops), rendered=self.metrics
            )
            self._metrics_requests = MetricsRequests(self.exposition)
        if cfg.http_port is not None:
            assert self.exposition is not None
            self.http = HttpServer(
                self.exposition,
                health=self.health,
                api_keys=cfg.api_key or (),
                guard_metrics=cfg.api_key_metrics,
            )
            await self.http.start(cfg.http_host, cfg.http_port)
        self._ctx = zmq.asyncio.Context()
        self.gate = gate = Gatekeeper(self._ctx, gate_policy(cfg))
        self._registry = registry = SocketRegistry()
        max_message_bytes = control_max_message_bytes(engine)
        # NOTE: every bind goes through the registry, which refuses an ipc:// path a live
        # socket owns (libzmq would silently take it over) and claims it (sockets.IpcClaim).
        control_sock = registry.make(
            self._ctx,
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
        kv_endpoints: list[str] = []
        replay_endpoints: list[str] = []
        fpm_endpoints: list[str] = []
        fpm_sinks: list[WorkerIdSink] = []
        controls: list[ControlServer] = []
        delivery = _LateDelivery(controls, self.metrics)
        if self.rank_processes:
            batch_bytes, hwms = await self._start_workers(delivery)
            for worker in self.workers:
                assert worker.ready is not None
                for ready in worker.ready.ranks:
                    if ready.kv_endpoint:
                        kv_endpoints.append(ready.kv_endpoint)
                    if ready.replay_endpoint:
                        replay_endpoints.append(ready.replay_endpoint)
                    if ready.fpm_endpoint:
                        fpm_endpoints.append(ready.fpm_endpoint)
            fpm_sinks.extend(
                RankWorkerId(worker, rank, self.worker_id)
                for worker in self.workers
                for rank in worker.ranks
            )
        else:
            # The byte budgets of slow KV subscribers and replay clients become message
            # bounds through the largest batch a pass can produce (engined.server.kv_publisher).
            batch_bytes = max_batch_bytes(engine, cfg.kv_events_format)
            self.pacing = shared_pacing(cfg)
            for rank in range(engine.dp_size):
                parts = build_rank(
                    self._ctx,
                    registry,
                    cfg,
                    rank,
                    worker_id=self.worker_id,
                    delivery=delivery,
                    batch_bytes=batch_bytes,
                    pacing=self.pacing,
                    gate=gate,
                )
                self._publishers.append(parts.kv)
                if parts.kv.endpoint:
                    kv_endpoints.append(parts.kv.endpoint)
                if parts.kv.replay_endpoint:
                    replay_endpoints.append(parts.kv.replay_endpoint)
                if parts.fpm.endpoint:
                    fpm_endpoints.append(parts.fpm.endpoint)
                fpm_sinks.append(parts.fpm)
                self.loops.append(parts.loop)
            hwms = (self._publishers[0].hwm, self._publishers[0].replay_hwm)

        settings = RuntimeSettings(
            vocab_size=engine.vocab_size,
            excluded_token_ids=engine.excluded_token_ids,
            fpm_worker_id=self.worker_id,
            fpm=fpm_sinks,
        )

        def welcome() -> wire.Welcome:
            return wire.Welcome(
                protocol=wire.PROTOCOL_VERSION,
                version=engined.__version__,
                engine_type=engine.engine_type,
                worker_type=engine.worker_type,
                block_size=engine.block_size,
                num_gpu_blocks=engine.num_gpu_blocks,
                dp_size=engine.dp_size,
                model_name=cfg.model_name,
                kv_events_endpoints=kv_endpoints,
                kv_replay_endpoints=replay_endpoints,
                fpm_endpoints=fpm_endpoints,
                max_num_seqs=engine.max_num_seqs,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                max_model_len=context_length(
                    engine.num_gpu_blocks, engine.block_size, engine.max_model_len
                ),
                enable_prefix_caching=engine.enable_prefix_caching,
                kv_events_topic=cfg.kv_events_topic,
                kv_events_format=cfg.kv_events_format,
                vocab_size=settings.vocab_size,
                excluded_token_ids=list(settings.excluded_token_ids),
                fpm_worker_id=settings.fpm_worker_id,
                speedup_ratio=engine.speedup_ratio,
                operator_endpoint=operator.advertised,
                instance_id=self.instance_id,
            )

        if self.metrics is not None:
            for loop in self.loops:
                self.metrics.attach(loop)
            # In worker mode the proxies carry the same counters, as of each heartbeat.
            self.metrics.watch_publishers(self._publishers or self._proxies)
        self.control = ControlServer(
            control_sock,
            self.loops,
            welcome=welcome,
            instance_id=self.instance_id,
            settings=settings,
            max_queued_requests=cfg.max_queued_requests,
            handoff_timeout_s=engine.handoff_session_timeout_ms / 1000.0,
            deadlines=None if self.pacing is None else self.pacing.deadlines,
            inflight_bytes=cfg.control_inflight_bytes,
            unread_messages=CONTROL_HWM,
            unread_bytes=cfg.control_unread_bytes,
            metrics=self._metrics_requests,
        )
        controls.append(self.control)
        if self.metrics is not None:
            control = self.control
            self.metrics.watch_queue_refusals(lambda: control.queue_refusals)
        for kv in self._publishers:
            kv.start()
        self._tasks.append(asyncio.create_task(self.control.serve(), name="control"))
        self._tasks.append(
            asyncio.create_task(self.control.expire_handoffs(), name="handoff-timeouts")
        )
        work = trim_when_idle(self._idle, lambda: sum(loop.tokens_total for loop in self.loops))
        self._tasks.append(asyncio.create_task(work, name="heap-trim"))
        if self.workers:
            for worker in self.workers:
                name = f"rank-worker-{worker.index}"
                self._tasks.append(asyncio.create_task(worker.run(), name=name))
        else:
            for loop in self.loops:
                self._tasks.append(asyncio.create_task(loop.run(), name=f"rank-{loop.rank}"))
        if cfg.api_port is not None:
            from engined.server.api_servers import ApiServers

            self.api = ApiServers(cfg)
            await self.api.start()
            self._tasks.append(asyncio.create_task(self.api.watch(), name="api-servers"))
        self.started = True
        self._collection = start_collection(cfg, self.pacing)
        log.info(
            "engined started",
            version=engined.__version__,
            core=str(running_core()),
            pid=os.getpid(),
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            control_endpoint=cfg.control_endpoint,
            kv_events_endpoints=kv_endpoints,
            kv_replay_endpoints=replay_endpoints,
            fpm_endpoints=fpm_endpoints,
            engine=engine_summary(cfg),
            limits=limits(cfg, hwms, batch_bytes, max_message_bytes),
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

    async def _start_workers(self, delivery: _LateDelivery) -> tuple[int, tuple[int, int]]:
        """Start the rank worker processes and wait until every one has bound its ranks.

        Each worker gets a PAIR in a private directory. Raises OSError when one fails to
        start (a start-up failure, as a bind failure in process is). Returns the KV batch
        bound and rank 0's high-water marks, for the start-up log.
        """
        assert self._ctx is not None and self._registry is not None
        cfg = self.config
        self._worker_dir = tempfile.mkdtemp(prefix="engined-ranks-")
        paced = cfg.engine.speedup_ratio > 0
        for index, ranks in enumerate(split_ranks(cfg.engine.dp_size, self.rank_processes)):
            endpoint = f"ipc://{self._worker_dir}/worker-{index}"
            self.workers.append(
                WorkerProcess(
                    index,
                    ranks,
                    ctx=self._ctx,
                    registry=self._registry,
                    endpoint=endpoint,
                    delivery=delivery,
                    paced=paced,
                )
            )
        # Heartbeats at least 4 times per watchdog ping interval, so one late frame is not
        # yet a silent worker (workers_healthy).
        heartbeat_s = min(WORKER_HEARTBEAT_S, (self._watchdog_s or math.inf) / 4)
        started = await asyncio.gather(
            *(
                worker.start(cfg, worker_id=self.worker_id, heartbeat_s=heartbeat_s)
                for worker in self.workers
            ),
            return_exceptions=True,
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        for worker in self.workers:
            self._proxies.extend(worker.proxies[rank] for rank in worker.ranks)
        self.loops.extend(self._proxies)
        ready = self.workers[0].ready
        assert ready is not None
        return ready.batch_bytes, (ready.ranks[0].kv_hwm, ready.ranks[0].replay_hwm)

    def workers_healthy(self) -> bool:
        """Whether every rank worker was heard from within a watchdog ping interval: the
        systemd watchdog is pinged only then, so a stuck worker gets the daemon restarted."""
        silence = self._watchdog_s if self._watchdog_s is not None else math.inf
        return all(worker.healthy(silence) for worker in self.workers)

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
        for kv in self._publishers:
            await kv.close()
        for worker in self.workers:
            worker.kill()
        if self._registry is not None:
            self._registry.close()
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._worker_dir is not None:
            shutil.rmtree(self._worker_dir, ignore_errors=True)
            self._worker_dir = None
        self._notifier.close()
        if self._collection is not None:
            self._collection.close()

    def _status_line(self) -> str:
        """systemd's STATUS=, one line: load, and output tokens/s since the previous line."""
        now = time.monotonic()
        tokens = sum(loop.tokens_total for loop in self.loops)
        rate = (tokens - self._status_tokens) / max(now - self._status_at, 1e-6)
        self._status_tokens, self._status_at = tokens, now
        metrics = [loop.engine.metrics() for loop in self.loops]
        line = (
            f"{len(self.loops)} ranks, {sum(m.running for m in metrics)} running, "
            f"{sum(m.waiting for m in metrics)} waiting, {rate:.0f} tokens/s"
        )
        return f"stopping: {line}" if self.control and self.control.shutting_down else line


class _LateDelivery:
    """Forwards to the control server, which is built after the loops it routes for; the
    metrics read handoff events on the way (a destination's transferred prompt tokens)."""

    def __init__(self, controls: list[ControlServer], metrics: VllmMetrics | None) -> None:
        self._controls = controls
        self._metrics = metrics

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self._controls[0].deliver_outputs(rank, outputs, decodes)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        if self._metrics is not None:
            self._metrics.on_lifecycle(rank, events)
        self._controls[0].deliver_lifecycle(rank, events)


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
