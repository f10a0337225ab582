"""`RankProxy`: a rank that runs in a worker process, as the daemon's `RankHandle`.

The control server, the load watch, the metrics and the daemon use it exactly as an
in-process `EngineLoop`. `gauges` answers from what its worker last reported
(`rank_wire.Gauges`, the gauges of every pass and command), so reading costs no round trip;
`call`, `until_idle` and `fresh_gauges` wait for the worker, and concurrent `fresh_gauges`
share one request, so a flood of scrapes or `stats` costs the worker one request per round
trip, not one each. Its `WorkerProcess` (`engined.server.ranks.rank_process`) feeds it the worker's
items in the order the rank produced them: for a command, the command observers, then the
caller's future (as `EngineLoop._drain_inbox` does); for a pass, the pass observers, before
the pass's outputs go to the clients.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import structlog

from engined.core.command_report import CommandReport
from engined.core.types import Command, Decodes, EngineMetrics, RequestOutput
from engined.model_clock import ModelClock
from engined.server.ranks import rank_wire as w
from engined.server.ranks.rank_gauges import RankGauges
from engined.server.ranks.rank_sinks import CommandObserver, PassObserver

log = structlog.get_logger(__name__)


class ReplayCounters:
    """A worker's replay server counters, as of its latest heartbeat (the `ReplayServer`
    attributes `engined.server.publish.prometheus_publishers` reads)."""

    def __init__(self) -> None:
        self.abandoned = 0
        self.refused = 0
        self.streaming = 0


class WorkerLink(Protocol):
    """What a proxy needs of its worker process (`rank_process.WorkerProcess`)."""

    @property
    def finished(self) -> asyncio.Future[None]: ...

    def submit(
        self, proxy: RankProxy, command: Command, future: asyncio.Future[CommandReport] | None
    ) -> None: ...

    async def until_idle(self, rank: int) -> None: ...

    async def refresh(self, rank: int) -> None: ...

    def stop_rank(self, rank: int) -> None: ...


class RankProxy:
    """One rank of a worker process, as a `RankHandle`."""

    def __init__(self, worker: WorkerLink, ready: w.RankReady, *, model_clock: ModelClock) -> None:
        self._worker = worker
        self.rank = ready.rank
        self.capacity_tokens = ready.num_blocks * ready.block_size
        self._metrics: EngineMetrics = ready.metrics
        self.model_clock = model_clock
        self.queued = 0  # commands sent and not yet applied (or refused)
        self._passes_total = 0
        self._tokens_total = 0
        self.kv_overflows = 0
        self._lateness = (0.0, 0.0, 0.0)
        self._refreshing: asyncio.Future[None] | None = None
        self.replay = ReplayCounters() if ready.replay_endpoint is not None else None
        self._now_ms = 0.0
        self._now_at = time.monotonic()
        self._last_outputs: list[RequestOutput] = []
        self._last_decodes = Decodes()
        self.pass_observers: list[PassObserver] = []
        self.command_observers: list[CommandObserver] = []

    @property
    def overflows(self) -> int:
        """`kv_overflows` under the name the publisher metrics read."""
        return self.kv_overflows

    def backlog(self) -> int:
        return self._metrics.waiting + self.queued

    def gauges(self) -> RankGauges:
        """As of the worker's latest report; lateness as of its latest heartbeat or
        `fresh_gauges` (at most a heartbeat interval old)."""
        return RankGauges(
            self._metrics, self._passes_total, self._tokens_total, self.kv_overflows, self._lateness
        )

    async def fresh_gauges(self) -> RankGauges:
        """Once the worker has sent every figure of the rank as of now (the replay counters
        too). A caller that gives up (a scrape's bound) leaves the request to the others."""
        pending = self._refreshing
        if pending is None or pending.done():
            pending = self._refreshing = asyncio.ensure_future(self._worker.refresh(self.rank))
        await asyncio.shield(pending)
        return self.gauges()

    def now_ms(self) -> float:
        """The rank's modelled clock: its last report plus, paced, the wall time since."""
        return self._now_ms + self.model_clock.to_modelled_ms(time.monotonic() - self._now_at)

    def send(self, command: Command) -> None:
        self._worker.submit(self, command, None)

    async def call(self, command: Command) -> CommandReport:
        future: asyncio.Future[CommandReport] = asyncio.get_running_loop().create_future()
        self._worker.submit(self, command, future)
        return await future

    async def until_idle(self) -> None:
        """As `EngineLoop.until_idle`, answered by the worker after everything it sent before."""
        await self._worker.until_idle(self.rank)

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
        future: asyncio.Future[CommandReport] | None,
    ) -> None:
        self.queued -= 1
        self._metrics = item.metrics
        report = item.report
        for observer in self.command_observers:
            observer(self.rank, item.arrived_ms, command, report)
        if future is not None and not future.done():
            future.set_result(report)

    def on_failure(
        self, item: w.Failure, command: Command, future: asyncio.Future[CommandReport] | None
    ) -> None:
        self.queued -= 1
        if future is None:
            log.warning("command refused", command=type(command).__name__, error=item.error.message)
        elif not future.done():
            future.set_exception(item.error.error())

    def on_pass(self, item: w.Pass) -> None:
        report = item.report
        self._metrics = report.metrics
        self._last_outputs = report.outputs
        self._last_decodes = report.decodes
        for observer in self.pass_observers:
            observer(self.rank, item.start_ms, report)

    def outputs_of(self, item: w.Outputs) -> tuple[list[RequestOutput], Decodes]:
        if item.outputs is None or item.decodes is None:
            return self._last_outputs, self._last_decodes
        return item.outputs, item.decodes

    def on_gauges(self, item: w.Gauges) -> None:
        self._now_ms, self._now_at = item.now_ms, time.monotonic()
        self._passes_total = item.passes_total
        self._tokens_total = item.tokens_total
        self.kv_overflows = item.kv_overflows
        if item.metrics is not None:
            self._metrics = item.metrics
        if item.lateness is not None:
            self._lateness = item.lateness
        if item.replay is not None and self.replay is not None:
            self.replay.abandoned, self.replay.refused, self.replay.streaming = item.replay
