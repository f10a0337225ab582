"""The daemon's side of rank worker processes: `WorkerProcess` (one per process) and
`RankProxy` (one per rank, a `RankHandle` the control server uses as it uses an EngineLoop).

A proxy answers everything the control server, `stats`, `load`, `/metrics` and the systemd
status read from what the worker last reported (`rank_wire.Gauges`, the gauges of every pass
and command), so none of them costs a round trip; only `call` waits for the worker. The
worker's items are replayed in the order the rank produced them: command observers, then the
caller's future, then lifecycle events, as `EngineLoop._drain_inbox` does; pass observers
before the pass's outputs. Before delivering outputs that follow a reply in the same frame,
the reader yields once, so the caller's `submitted` goes out before the request's first
output, as it does in process.

A worker that exits before it was told to stop fails `WorkerProcess.run` with
`RankWorkerDied` naming its ranks: the daemon ends non-zero, as when a rank task fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import msgspec
import structlog
import zmq
import zmq.asyncio

from engined.config import DaemonConfig
from engined.core.types import (
    Command,
    CommandEffects,
    EngineMetrics,
    FpmSnapshot,
    PassResult,
    RequestOutput,
)
from engined.server import rank_wire as w
from engined.server.engine_loop import CommandObserver, Delivery, PassObserver
from engined.zmq_sockets import SocketRegistry

log = structlog.get_logger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "engined.server.rank_worker")
STARTUP_TIMEOUT_S = 60.0
# After a stopped worker exits, how long its last frames may take to be read.
FINAL_FRAMES_S = 1.0
_EMPTY_FPM = FpmSnapshot()


class RankWorkerDied(RuntimeError):
    """A rank worker process exited without being told to stop (crash, kill, bug)."""


class _Gauges:
    """The `EngineView` of a remote rank: its engine's gauges as last reported."""

    def __init__(self, ready: w.RankReady) -> None:
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size
        self._metrics = ready.metrics
        self._num_waiting = ready.metrics.waiting

    def update(self, metrics: EngineMetrics, num_waiting: int) -> None:
        self._metrics = metrics
        self._num_waiting = num_waiting

    def metrics(self) -> EngineMetrics:
        return self._metrics

    def num_waiting(self) -> int:
        return self._num_waiting


class RankProxy:
    """One rank of a worker process, as a `RankHandle`."""

    def __init__(self, worker: WorkerProcess, ready: w.RankReady, *, paced: bool) -> None:
        self._worker = worker
        self.rank = ready.rank
        self.engine = _Gauges(ready)
        self._paced = paced
        self.queued = 0  # commands sent and not yet applied (or refused)
        self.passes_total = 0
        self.tokens_total = 0
        self.kv_overflows = 0
        self._lateness = (0.0, 0.0, 0.0)
        self._now_ms = 0.0
        self._now_at = time.monotonic()
        self._last_outputs: list[RequestOutput] = []
        self.pass_observers: list[PassObserver] = []
        self.command_observers: list[CommandObserver] = []

    def lateness_summary(self) -> tuple[float, float, float]:
        """As of the worker's latest heartbeat (at most a heartbeat interval old)."""
        return self._lateness

    def now_ms(self) -> float:
        """The rank's clock: when paced, its last report plus the wall time since."""
        if self._paced:
            return self._now_ms + (time.monotonic() - self._now_at) * 1000.0
        return self._now_ms

    def send(self, command: Command) -> None:
        self._worker.submit(self, command, None)

    async def call(self, command: Command) -> CommandEffects:
        future: asyncio.Future[CommandEffects] = asyncio.get_running_loop().create_future()
        self._worker.submit(self, command, future)
        return await future

    def stop(self) -> None:
        self._worker.stop_rank(self.rank)

    async def run(self) -> None:
        """Returns once the worker has drained and exited; raises if it died."""
        await asyncio.shield(self._worker.finished)

    # --- the worker's items ---------------------------------------------------------------

    def on_reply(
        self,
        item: w.Reply,
        command: Command,
        future: asyncio.Future[CommandEffects] | None,
    ) -> None:
        self.queued -= 1
        self.engine.update(item.metrics, item.num_waiting)
        effects = CommandEffects(
            result=w.decode_result(item.result_kind, item.result_text),
            lifecycle_events=item.lifecycle_events,
            ended=item.ended,
            progressed=item.progressed,
        )
        for observer in self.command_observers:
            observer(self.rank, item.arrived_ms, command, effects)
        if future is not None and not future.done():
            future.set_result(effects)

    def on_failure(
        self, item: w.Failure, command: Command, future: asyncio.Future[CommandEffects] | None
    ) -> None:
        self.queued -= 1
        if future is None:
            log.warning("command refused", command=type(command).__name__, error=item.message)
        elif not future.done():
            future.set_exception(w.rebuild_error(item.error_class, item.code, item.message))

    def on_pass(self, item: w.Pass) -> None:
        self.engine.update(item.metrics, item.num_waiting)
        self._last_outputs = item.outputs
        if not self.pass_observers:
            return
        result = PassResult(
            end_ms=item.end_ms,
            outputs=item.outputs,
            ended=item.ended,
            admissions=item.admissions,
            lifecycle_events=[],
            metrics=item.metrics,
            kv_events=[],
            fpm=_EMPTY_FPM,
            prefix_cache_queries=item.prefix_cache_queries,
            prefix_cache_hits=item.prefix_cache_hits,
            accept_length_output_tokens=item.accept_length_output_tokens,
            accept_length_decode_forwards=item.accept_length_decode_forwards,
        )
        for observer in self.pass_observers:
            observer(self.rank, item.start_ms, result)

    def outputs_of(self, item: w.Outputs) -> list[RequestOutput]:
        return self._last_outputs if item.outputs is None else item.outputs

    def on_gauges(self, item: w.Gauges) -> None:
        self._now_ms, self._now_at = item.now_ms, time.monotonic()
        self.passes_total = item.passes_total
        self.tokens_total = item.tokens_total
        self.kv_overflows = item.kv_overflows
        if item.metrics is not None:
            self.engine.update(item.metrics, item.num_waiting)
        if item.lateness is not None:
            self._lateness = item.lateness


_Pending = tuple[RankProxy, Command, "asyncio.Future[CommandEffects] | None"]


class WorkerProcess:
    """One rank worker process: starts it, feeds it commands, replays what it reports."""

    def __init__(
        self,
        index: int,
        ranks: Sequence[int],
        *,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        endpoint: str,
        delivery: Delivery,
        paced: bool,
    ) -> None:
        self.index = index
        self.ranks = list(ranks)
        self._sock = registry.make(ctx, zmq.PAIR, endpoint, bind=True, sndhwm=0, rcvhwm=0)
        self._send = w.pair_sender(self._sock)
        self._endpoint = endpoint
        self._delivery = delivery
        self._paced = paced
        self._proc: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._poller: asyncio.Future[None] | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Nobody may await `finished` (the daemon watches `run`): never an unretrieved error.
        self.finished.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.proxies: dict[int, RankProxy] = {}
        self._corr = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._stopping: set[int] = set()
        self._bye = asyncio.Event()
        self.last_heard = time.monotonic()
        self.ready: w.Ready | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def describe(self) -> str:
        return f"rank worker {self.index} (pid {self.pid}, ranks {self.ranks})"

    # --- start-up -------------------------------------------------------------------------

    async def start(self, config: DaemonConfig, *, worker_id: str, heartbeat_s: float) -> None:
        """Start the process and wait until its ranks are bound and ready.

        Raises OSError when it reports a bind failure or exits first (a start-up failure).
        """
        init = w.RankInit(
            config=msgspec.json.encode(config),
            ranks=self.ranks,
            endpoint=self._endpoint,
            worker_id=worker_id,
            parent_pid=os.getpid(),
            heartbeat_s=heartbeat_s,
        )
        self._proc = proc = subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE)
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(w.encoder.encode(init))
        self._watch_exit(proc)
        first = asyncio.ensure_future(self._sock.recv())
        try:
            done, _ = await asyncio.wait(
                (first, self._exited), timeout=STARTUP_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            if not first.done():
                first.cancel()
        if first not in done:
            code = self._exited.result() if self._exited.done() else None
            raise OSError(f"{self.describe()} did not start (exit code {code})")
        (item,) = w.item_decoder.decode(first.result())
        if isinstance(item, w.StartupFailed):
            raise OSError(f"{self.describe()}: {item.error}")
        assert isinstance(item, w.Ready), item
        self.ready = item
        for rank_ready in item.ranks:
            self.proxies[rank_ready.rank] = RankProxy(self, rank_ready, paced=self._paced)
        self.last_heard = time.monotonic()

    def _watch_exit(self, proc: subprocess.Popen[bytes]) -> None:
        """Resolve `_exited` with the exit code when the process ends (a pidfd, or polling)."""
        loop = asyncio.get_running_loop()

        def reap() -> None:
            if self._pidfd is not None:
                loop.remove_reader(self._pidfd)
            code = proc.wait()
            if not self._exited.done():
                self._exited.set_result(code)

        try:
            self._pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self._poller = asyncio.ensure_future(self._poll_exit(proc))
            return
        loop.add_reader(self._pidfd, reap)

    async def _poll_exit(self, proc: subprocess.Popen[bytes]) -> None:
        while (code := proc.poll()) is None:
            await asyncio.sleep(0.1)
        if not self._exited.done():
            self._exited.set_result(code)

    # --- serving --------------------------------------------------------------------------

    async def run(self) -> None:
        """Read the worker's frames until it exits; raises RankWorkerDied if it was not
        stopped (or exited non-zero)."""
        reader = asyncio.ensure_future(self._read())
        try:
            done, _ = await asyncio.wait(
                (reader, self._exited), return_when=asyncio.FIRST_COMPLETED
            )
            if reader in done:
                reader.result()  # a frame this build cannot read: a bug
            code = await self._exited
            if self.stopping and code == 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._bye.wait(), FINAL_FRAMES_S)
                self.finished.set_result(None)
                return
            reason = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            log.error("rank worker died", worker=self.index, pid=self.pid, ranks=self.ranks,
                      reason=reason)  # fmt: skip
            error = RankWorkerDied(f"{self.describe()} died: {reason}")
            self.finished.set_exception(error)
            raise error
        finally:
            reader.cancel()
            if not self.finished.done():
                self.finished.set_exception(RankWorkerDied(f"{self.describe()} abandoned"))
            self.kill()

    @property
    def stopping(self) -> bool:
        return self._stopping.issuperset(self.ranks)

    def healthy(self, max_silence_s: float) -> bool:
        """Whether the worker was heard from within `max_silence_s` (heartbeats included)."""
        return not self._exited.done() and time.monotonic() - self.last_heard <= max_silence_s

    async def _read(self) -> None:
        sock = self._sock
        proxies = self.proxies
        pending = self._pending
        delivery = self._delivery
        while True:
            frame = await sock.recv()
            self.last_heard = time.monotonic()
            replied = False
            for item in w.item_decoder.decode(frame):
                match item:
                    case w.Reply():
                        proxy, command, future = pending.pop(item.corr)
                        proxy.on_reply(item, command, future)
                        replied = True
                    case w.Failure():
                        proxy, command, future = pending.pop(item.corr)
                        proxy.on_failure(item, command, future)
                        replied = True
                    case w.Pass():
                        proxies[item.rank].on_pass(item)
                    case w.Outputs():
                        if replied:
                            # Let the callers just answered send their replies first.
                            await asyncio.sleep(0)
                            replied = False
                        outputs = proxies[item.rank].outputs_of(item)
                        delivery.deliver_outputs(item.rank, outputs)
                    case w.Lifecycle():
                        delivery.deliver_lifecycle(item.rank, item.events)
                    case w.Gauges():
                        proxies[item.rank].on_gauges(item)
                    case w.Stopped():
                        self._bye.set()
                    case _:
                        raise RuntimeError(f"unexpected item from {self.describe()}: {item!r}")

    def submit(
        self,
        proxy: RankProxy,
        command: Command,
        future: asyncio.Future[CommandEffects] | None,
    ) -> None:
        corr = next(self._corr)
        self._pending[corr] = (proxy, command, future)
        proxy.queued += 1
        frame = w.encoder.encode((corr, proxy.rank, w.COMMAND_KIND[type(command)], command))
        self._send_frame(frame)

    def stop_rank(self, rank: int) -> None:
        self._stopping.add(rank)
        self._send_frame(w.encoder.encode((0, rank, w.STOP, None)))

    def set_fpm_worker_id(self, worker_id: str) -> None:
        self._send_frame(w.encoder.encode((0, self.ranks[0], w.FPM_WORKER_ID, worker_id)))

    def _send_frame(self, frame: bytes) -> None:
        if not self._send(frame):
            # No high-water mark: this fails only once the worker is gone, which ends us.
            log.warning("rank worker not reachable, command dropped", worker=self.index)

    def kill(self) -> None:
        """End the process now if it still runs (shutdown after the grace, or a failure)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


class WorkerIds:
    """`RuntimeSettings`' FPM sink for worker processes: a new id goes to every worker."""

    def __init__(self, workers: Sequence[WorkerProcess], worker_id: str) -> None:
        self._workers = workers
        self._worker_id = worker_id

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str) -> None:
        self._worker_id = value
        for worker in self._workers:
            worker.set_fpm_worker_id(value)


def split_ranks(dp_size: int, processes: int) -> list[list[int]]:
    """Contiguous blocks of ranks, as even as they go (4 ranks on 3 processes: [0], [1],
    [2, 3]); at most one process per rank."""
    processes = max(1, min(processes, dp_size))
    return [
        list(range(i * dp_size // processes, (i + 1) * dp_size // processes))
        for i in range(processes)
    ]
