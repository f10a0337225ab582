"""A rank worker process: the ranks a daemon gave it, on its own core and event loop.

`python -m engined.server.ranks.rank_worker` (started by `engined.server.ranks.rank_proxy`) reads
its `RankInit` from stdin, builds each rank exactly as an in-process daemon does
(`engined.server.ranks.rank_build.build_rank`: the same core, `EngineLoop` and publishers, bound to
the same per-rank endpoints), and talks to the daemon over one ZeroMQ PAIR (`rank_wire`).

A process started with `subprocess`, not `multiprocessing`: spawn re-imports the parent's
`__main__` (the CLI, or a test runner) and pickles its arguments, while this entry point
imports only what a rank needs and takes plain msgpack; the daemon watches its exit through a
pidfd, with no child watcher.

The daemon owns the lifecycle: SIGINT and SIGTERM are ignored here (a terminal's Ctrl-C
reaches the whole process group; the daemon drains and then stops us), and the worker dies
with the daemon (PR_SET_PDEATHSIG, and a parent check each heartbeat) instead of serving
endpoints nobody routes to.

What the daemon needs leaves in one frame per event-loop turn or two (`Outbox`): a pass's
observer data and its outputs travel together, outputs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Coroutine

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined import event_loop
from engined.config import DaemonConfig
from engined.core.command_report import CommandReport
from engined.core.errors import CoreError, CoreFailure
from engined.core.pass_report import PassReport
from engined.core.types import Command, Decodes, LifecycleEvent, RequestOutput
from engined.logs import configure_logging
from engined.model_clock import ModelClock
from engined.server.publish.fpm_publisher import FpmPublisher, NullFpmPublisher
from engined.server.publish.kv_publisher import AnyKvPublisher, max_batch_bytes
from engined.server.ranks import rank_wire as w
from engined.server.ranks.collector import Collector, YoungGeneration
from engined.server.ranks.engine_loop import EngineLoop
from engined.server.ranks.rank_build import build_rank, shared_pacing, start_collection
from engined.server.ranks.realtime import enter_realtime
from engined.server.security.access import AccessError, gate_policy
from engined.server.security.gatekeeper import Gatekeeper
from engined.zmq_sockets import SocketRegistry, make_socket

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_STARTUP = 3
_PR_SET_PDEATHSIG = 1


class Outbox:
    """Items for the daemon, in the order they happened, sent one frame per turn or two.

    The flush runs two event-loop turns after the first item: at speedup 0 a rank's pass
    (observer data) and its delivery (after the pass's `sleep(0)`) are one turn apart, so
    they leave together. Each frame ends with the counters of the ranks it concerns.
    """

    def __init__(self, send: Callable[[bytes], bool]) -> None:
        self._send = send
        self._items: list[w.Item] = []
        self._touched: set[int] = set()
        self._scheduled = False
        self.loops: dict[int, EngineLoop] = {}
        self.last_outputs: dict[int, list[RequestOutput]] = {}

    def add(self, item: w.Item, rank: int | None = None) -> None:
        self._items.append(item)
        if rank is not None:
            self._touched.add(rank)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._items:
            return
        items, self._items = self._items, []
        for rank in sorted(self._touched):
            loop = self.loops[rank]
            items.append(
                w.Gauges(
                    rank, loop.now_ms(), loop.passes_total, loop.tokens_total, loop.kv_overflows
                )
            )
        self._touched.clear()
        self.send_now(items)

    def send_now(self, items: list[w.Item]) -> None:
        # NOTE: a send blocks while the daemon is WORKER_FRAMES_AHEAD frames behind (flow
        # control), and fails only once the daemon is gone, when we are about to die too.
        if not self._send(w.encoder.encode(items)):
            log.warning("daemon not reachable, frame dropped", items=len(items))


class _Delivery:
    """The loops' `Delivery`: outputs and lifecycle events become outbox items."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        if self._outbox.last_outputs.get(rank) is outputs:
            self._outbox.add(w.Outputs(rank, None, None), rank)
        else:
            self._outbox.add(w.Outputs(rank, outputs, decodes), rank)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        self._outbox.add(w.Lifecycle(rank, events), rank)


class RankWorker:
    """The ranks of one worker process and their link to the daemon.

    Its `ModelClock` is its own, built from the daemon's config as the daemon builds its
    one (a clock cannot be shared across processes; the same config makes them map at the
    same ratio), and every rank of the process is paced by it.
    """

    def __init__(self, init: w.RankInit, config: DaemonConfig) -> None:
        self._init = init
        self._config = config
        self._ctx = zmq.asyncio.Context()
        self._registry = SocketRegistry()
        # Set by _build: the ZAP handler of this process's sockets
        # (engined.server.security.gatekeeper).
        self._gate: Gatekeeper | None = None
        self._loops: dict[int, EngineLoop] = {}
        self._kvs: list[AnyKvPublisher] = []
        self._kv_of: dict[int, AnyKvPublisher] = {}
        self._fpm_of: dict[int, FpmPublisher | NullFpmPublisher] = {}
        # id(command) -> correlation id, from the command's arrival until it is applied.
        self._pending: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Future[BaseException] | None = None
        self._model_clock = ModelClock(config.engine.speedup_ratio)
        self._pacing = shared_pacing(self._model_clock)
        self._collection: Collector | YoungGeneration | None = None

    async def serve(self) -> int:
        self._failed = asyncio.get_running_loop().create_future()
        sock = self._registry.add(
            make_socket(
                self._ctx,
                zmq.PAIR,
                self._init.endpoint,
                bind=False,
                sndhwm=w.WORKER_FRAMES_AHEAD,
                rcvhwm=0,
            )
        )
        outbox = self._outbox = Outbox(w.pair_sender(sock, block=True))
        try:
            ready = self._build(outbox)
        except (zmq.ZMQError, OSError, AccessError) as exc:
            outbox.send_now([w.StartupFailed(str(exc))])
            await self._close()
            return EXIT_STARTUP
        outbox.send_now([ready])
        self._collection = start_collection(self._model_clock, self._pacing)
        for kv in self._kvs:
            kv.start()
        runs = {
            asyncio.create_task(loop.run(), name=f"rank-{rank}"): rank
            for rank, loop in self._loops.items()
        }
        reader = asyncio.create_task(self._read(sock), name="commands")
        heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
        code = EXIT_OK
        try:
            pending: set[asyncio.Future[object]] = {*runs, reader, heartbeat, self._failed}  # type: ignore[arg-type]
            while runs.keys() & pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = [f for f in done if f not in runs or f.exception() is not None]
                if failed:
                    for future in failed:
                        error = future.result() if future is self._failed else future.exception()
                        rank = runs.get(future)  # type: ignore[call-overload]
                        log.error("fatal error in rank worker", rank=rank, exc_info=error)
                    code = EXIT_FAILURE
                    break
            if code == EXIT_OK:
                outbox.flush()
                outbox.send_now([w.Stopped()])
        finally:
            for task in (reader, heartbeat, *runs):
                task.cancel()
            await self._close()
        return code

    def _build(self, outbox: Outbox) -> w.Ready:
        cfg = self._config
        if cfg.realtime_priority:
            enter_realtime(cfg.realtime_priority)  # inherited already; this covers a spawn
        batch_bytes = max_batch_bytes(cfg.engine, cfg.kv_events_format)
        delivery = _Delivery(outbox)
        self._gate = gate = Gatekeeper(self._ctx, gate_policy(cfg))
        ready: list[w.RankReady] = []
        for rank in self._init.ranks:
            loop, kv, fpm = build_rank(
                self._ctx,
                self._registry,
                cfg,
                rank,
                worker_id=self._init.worker_id,
                delivery=delivery,
                batch_bytes=batch_bytes,
                model_clock=self._model_clock,
                pacing=self._pacing,
                gate=gate,
            )
            loop.pass_observers.append(self._on_pass)
            loop.command_observers.append(self._on_command)
            self._loops[rank] = outbox.loops[rank] = loop
            self._kvs.append(kv)
            self._kv_of[rank] = kv
            self._fpm_of[rank] = fpm
            ready.append(
                w.RankReady(
                    rank,
                    kv.endpoint,
                    kv.replay_endpoint,
                    fpm.endpoint,
                    loop.engine.usable_blocks,
                    loop.engine.block_size,
                    kv.hwm,
                    kv.replay_hwm,
                    loop.engine.metrics(),
                )
            )
        return w.Ready(ready, batch_bytes)

    # --- observers: what the daemon's observers and callers will see ---------------------

    def _on_pass(self, rank: int, start_ms: float, report: PassReport) -> None:
        outbox = self._outbox
        outbox.last_outputs[rank] = report.outputs
        outbox.add(w.Pass(rank, start_ms, report), rank)

    def _on_command(
        self, rank: int, arrived_ms: float, command: Command, report: CommandReport
    ) -> None:
        corr = self._pending.pop(id(command), 0)
        metrics = self._loops[rank].engine.metrics()
        self._outbox.add(w.Reply(corr, rank, arrived_ms, report, metrics), rank)

    # --- the daemon's messages ------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frame = await sock.recv()
            try:
                corr, rank, order = w.order_decoder.decode(frame)
                rank_loop = self._loops[rank]
                match order:
                    case w.StopRank():
                        # call_soon: after the first steps of the command tasks made before
                        # it, so every command sent before the stop reaches the inbox first.
                        loop.call_soon(rank_loop.stop)
                    case w.UntilIdle():
                        self._spawn(self._until_idle(rank_loop, corr))
                    case w.SendGauges():
                        self._outbox.add(self._gauges(rank, rank_loop), rank)
                        self._outbox.add(w.Done(corr), rank)
                    case w.SetFpmWorkerId(worker_id):
                        self._fpm_of[rank].worker_id = worker_id
                    case _:
                        self._spawn(self._call(rank_loop, corr, order))
            except (msgspec.DecodeError, KeyError) as exc:
                # The daemon is the same build; this is a bug, and the daemon goes on.
                log.error("bad frame from the daemon", error=str(exc))

    async def _call(self, loop: EngineLoop, corr: int, command: Command) -> None:
        self._pending[id(command)] = corr
        try:
            await loop.call(command)
        except CoreError as exc:
            self._pending.pop(id(command), None)
            self._outbox.add(w.Failure(corr, loop.rank, CoreFailure.of(exc)), loop.rank)

    async def _until_idle(self, loop: EngineLoop, corr: int) -> None:
        await loop.until_idle()
        self._outbox.add(w.Done(corr), loop.rank)

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failed is not None and not self._failed.done():
            self._failed.set_result(exc)

    async def _heartbeat(self) -> None:
        """Gauges of every rank each `heartbeat_s`: proof of life for the systemd watchdog
        (this loop turns), and the figures only worth reading now and then (lateness)."""
        init = self._init
        while True:
            if os.getppid() != init.parent_pid:
                log.error("the daemon is gone, exiting", parent_pid=init.parent_pid)
                os._exit(EXIT_FAILURE)
            for rank, loop in self._loops.items():
                self._outbox.add(self._gauges(rank, loop))
            await asyncio.sleep(init.heartbeat_s)

    def _gauges(self, rank: int, loop: EngineLoop) -> w.Gauges:
        """Every figure of a rank, lateness and replay counters included (heartbeats and
        `stats`; passes send only the cheap ones)."""
        gauges = loop.gauges()
        replay = self._kv_of[rank].replay
        return w.Gauges(
            rank,
            loop.now_ms(),
            gauges.passes_total,
            gauges.tokens_total,
            gauges.kv_overflows,
            gauges.metrics,
            gauges.lateness_ms,
            None if replay is None else (replay.abandoned, replay.refused, replay.streaming),
        )

    async def _close(self) -> None:
        if self._collection is not None:
            self._collection.close()
        for kv in self._kvs:
            with contextlib.suppress(Exception):
                await kv.close()
        self._registry.close()
        if self._gate is not None:
            self._gate.close()
        self._ctx.term()


def _die_with_parent() -> None:
    """Linux: SIGKILL us when the daemon (the thread that started us) dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    init = w.init_decoder.decode(sys.stdin.buffer.read())
    if os.getppid() != init.parent_pid:
        return EXIT_FAILURE  # the daemon died before PR_SET_PDEATHSIG took effect
    config = msgspec.json.decode(init.config, type=DaemonConfig)
    configure_logging(config.log_format, config.log_level)
    structlog.contextvars.bind_contextvars(rank_worker=os.getpid(), ranks=init.ranks)
    return event_loop.run(RankWorker(init, config).serve())


if __name__ == "__main__":
    sys.exit(main())
