"""The daemon's side of a rank worker process: `WorkerProcess` starts it, sends it the
commands of its ranks' `RankProxy`s, and replays what it reports to them.

Before delivering outputs that follow a reply in the same frame, the reader yields once, so
the caller's `submitted` goes out before the request's first output, as it does in process.
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
from engined.core.command_report import CommandReport
from engined.core.types import Command
from engined.model_clock import ModelClock
from engined.server.ranks import rank_wire as w
from engined.server.ranks.rank_proxy import RankProxy
from engined.server.ranks.rank_sinks import Delivery
from engined.zmq_sockets import SocketRegistry

log = structlog.get_logger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "engined.server.ranks.rank_worker")
STARTUP_TIMEOUT_S = 60.0
# After a stopped worker exits, how long its last frames may take to be read.
FINAL_FRAMES_S = 1.0


class RankWorkerDied(RuntimeError):
    """A rank worker process exited without being told to stop (crash, kill, bug)."""


_Pending = tuple[RankProxy, Command, "asyncio.Future[CommandReport] | None"]


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
        model_clock: ModelClock,
    ) -> None:
        self.index = index
        self.ranks = list(ranks)
        # Commands in are bounded by the control server's limits (queued requests per rank);
        # frames out by the worker's flow control (rank_wire.WORKER_FRAMES_AHEAD).
        self._sock = registry.make(
            ctx, zmq.PAIR, endpoint, bind=True, sndhwm=0, rcvhwm=w.WORKER_FRAMES_AHEAD
        )
        self._send = w.pair_sender(self._sock)
        self._endpoint = endpoint
        self._delivery = delivery
        self._model_clock = model_clock
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
        self._answers: dict[int, asyncio.Future[None]] = {}  # UntilIdle, SendGauges by corr
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
            self.proxies[rank_ready.rank] = RankProxy(
                self, rank_ready, model_clock=self._model_clock
            )
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
            # A rank that stops releases its waiters (as EngineLoop's do).
            for waiter in self._answers.values():
                if not waiter.done():
                    waiter.set_result(None)
            self._answers.clear()
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
                        outputs, decodes = proxies[item.rank].outputs_of(item)
                        delivery.deliver_outputs(item.rank, outputs, decodes)
                    case w.Lifecycle():
                        delivery.deliver_lifecycle(item.rank, item.events)
                    case w.Gauges():
                        proxies[item.rank].on_gauges(item)
                    case w.Done():
                        waiter = self._answers.pop(item.corr, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_result(None)
                    case w.Stopped():
                        self._bye.set()
                    case _:
                        raise RuntimeError(f"unexpected item from {self.describe()}: {item!r}")

    def submit(
        self,
        proxy: RankProxy,
        command: Command,
        future: asyncio.Future[CommandReport] | None,
    ) -> None:
        corr = next(self._corr)
        self._pending[corr] = (proxy, command, future)
        proxy.queued += 1
        self._send_frame(w.encoder.encode((corr, proxy.rank, command)))

    async def until_idle(self, rank: int) -> None:
        await self._ask(rank, w.UntilIdle())

    async def refresh(self, rank: int) -> None:
        """Until the rank's full gauges (lateness, replay counters) have arrived."""
        await self._ask(rank, w.SendGauges())

    async def _ask(self, rank: int, order: w.UntilIdle | w.SendGauges) -> None:
        corr = next(self._corr)
        waiter = self._answers[corr] = asyncio.get_running_loop().create_future()
        self._send_frame(w.encoder.encode((corr, rank, order)))
        await waiter

    def stop_rank(self, rank: int) -> None:
        self._stopping.add(rank)
        self._send_frame(w.encoder.encode((0, rank, w.StopRank())))

    def set_fpm_worker_id(self, rank: int, worker_id: str) -> None:
        self._send_frame(w.encoder.encode((0, rank, w.SetFpmWorkerId(worker_id))))

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


class RankWorkerId:
    """`RuntimeSettings`' FPM sink for one rank of a worker process."""

    def __init__(self, worker: WorkerProcess, rank: int, worker_id: str) -> None:
        self._worker = worker
        self._rank = rank
        self._worker_id = worker_id

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str) -> None:
        self._worker_id = value
        self._worker.set_fpm_worker_id(self._rank, value)


def split_ranks(dp_size: int, processes: int) -> list[list[int]]:
    """Contiguous blocks of ranks, as even as they go (4 ranks on 3 processes: [0], [1],
    [2, 3]); at most one process per rank."""
    processes = max(1, min(processes, dp_size))
    return [
        list(range(i * dp_size // processes, (i + 1) * dp_size // processes))
        for i in range(processes)
    ]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which cgroups and taskset set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
