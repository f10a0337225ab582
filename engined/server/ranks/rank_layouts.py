"""Where a daemon's ranks run: in its own event loop, or in rank worker processes.

As uvicorn splits its `Config` (what to serve, decided before anything is bound) from its
`Server` (binding and serving), a layout is decided from the configuration alone
(`rank_layout`) and builds nothing until `start`, which binds every rank's sockets (or starts
the workers that bind them) and delivers to the control server that the daemon built before.
Both layouts then answer the same questions: the ranks' handles, the endpoints a `welcome`
advertises, the FPM worker-id sinks, the publishers the metrics watch, the tasks that run the
ranks, and what the start-up log reports of their limits. The daemon never branches on the
layout after choosing it.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
from collections.abc import Coroutine
from typing import NamedTuple

import msgspec
import zmq.asyncio

from engined.config import DaemonConfig
from engined.model_clock import ModelClock
from engined.server.publish.kv_publisher import AnyKvPublisher, max_batch_bytes
from engined.server.publish.prometheus_publishers import WatchedPublisher
from engined.server.ranks.rank_build import Pacing, build_rank, shared_pacing
from engined.server.ranks.rank_handle import RankHandle
from engined.server.ranks.rank_process import (
    RankWorkerId,
    WorkerProcess,
    available_cores,
    split_ranks,
)
from engined.server.ranks.rank_sinks import Delivery, WorkerIdSink
from engined.server.security.gatekeeper import Gatekeeper
from engined.zmq_sockets import SocketRegistry

# A rank worker's heartbeat period (seconds), shorter under a systemd watchdog (`WorkerRanks`).
WORKER_HEARTBEAT_S = 1.0


class RankEndpoints(msgspec.Struct):
    """What a `welcome` advertises of the ranks, in rank order (empty lists: turned off)."""

    kv_events: list[str] = msgspec.field(default_factory=list)
    kv_replay: list[str] = msgspec.field(default_factory=list)
    fpm: list[str] = msgspec.field(default_factory=list)

    def add(self, kv: str | None, replay: str | None, fpm: str | None) -> None:
        if kv:
            self.kv_events.append(kv)
        if replay:
            self.kv_replay.append(replay)
        if fpm:
            self.fpm.append(fpm)


class RankLimits(NamedTuple):
    """For the start-up log: the KV batch bound and rank 0's KV and replay high-water marks."""

    batch_bytes: int
    hwms: tuple[int, int]


class InProcessRanks:
    """Every rank an `EngineLoop` in the daemon's own event loop."""

    def __init__(self, config: DaemonConfig, *, worker_id: str) -> None:
        self._config = config
        self._worker_id = worker_id
        self.processes = 0
        # The daemon's one map of modelled time to the wall, for every rank and consumer.
        self.model_clock = ModelClock(config.engine.speedup_ratio)
        # What the paced ranks of this loop share (the control server reads the deadlines).
        self.pacing: Pacing | None = shared_pacing(self.model_clock)
        self.handles: list[RankHandle] = []
        self.endpoints = RankEndpoints()
        self.fpm_sinks: list[WorkerIdSink] = []
        self.publishers: list[AnyKvPublisher] = []
        self.limits = RankLimits(0, (0, 0))
        self.workers: list[WorkerProcess] = []

    async def start(
        self,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        gate: Gatekeeper,
        delivery: Delivery,
    ) -> None:
        """Bind every rank's publishers and build its core and loop.

        Raises zmq.ZMQError or OSError when a socket cannot be bound.
        """
        cfg = self._config
        # The byte budgets of slow KV subscribers and replay clients become message bounds
        # through the largest batch a pass can produce (engined.server.publish.kv_publisher).
        batch_bytes = max_batch_bytes(cfg.engine, cfg.kv_events_format)
        for rank in range(cfg.engine.dp_size):
            parts = build_rank(
                ctx,
                registry,
                cfg,
                rank,
                worker_id=self._worker_id,
                delivery=delivery,
                batch_bytes=batch_bytes,
                model_clock=self.model_clock,
                pacing=self.pacing,
                gate=gate,
            )
            self.publishers.append(parts.kv)
            self.endpoints.add(parts.kv.endpoint, parts.kv.replay_endpoint, parts.fpm.endpoint)
            self.fpm_sinks.append(parts.fpm)
            self.handles.append(parts.loop)
        first = self.publishers[0]
        self.limits = RankLimits(batch_bytes, (first.hwm, first.replay_hwm))
        for kv in self.publishers:
            kv.start()

    @property
    def watched_publishers(self) -> list[WatchedPublisher]:
        return list(self.publishers)

    def tasks(self) -> list[tuple[str, Coroutine[object, object, None]]]:
        return [(f"rank-{loop.rank}", loop.run()) for loop in self.handles]

    def healthy(self, max_silence_s: float) -> bool:
        """A rank in this loop is as alive as the loop that asks."""
        return True

    async def close(self) -> None:
        for kv in self.publishers:
            await kv.close()


class WorkerRanks:
    """The ranks in `processes` worker processes, contiguous blocks of ranks each
    (`split_ranks`), seen here through their `RankProxy`s."""

    def __init__(
        self,
        config: DaemonConfig,
        processes: int,
        *,
        worker_id: str,
        watchdog_s: float | None = None,
    ) -> None:
        """`watchdog_s` (systemd's ping interval): heartbeats at least 4 times per
        interval, so one late frame is not yet a silent worker (`healthy`)."""
        self._config = config
        self.processes = processes
        self._worker_id = worker_id
        self._watchdog_s = watchdog_s
        # The daemon's one map of modelled time to the wall: its proxies' `now_ms` (each
        # worker builds its own from the same config, for its ranks).
        self.model_clock = ModelClock(config.engine.speedup_ratio)
        # Paced ranks share deadlines within their worker, not with the daemon's loop.
        self.pacing: Pacing | None = None
        self.handles: list[RankHandle] = []
        self.endpoints = RankEndpoints()
        self.fpm_sinks: list[WorkerIdSink] = []
        self.limits = RankLimits(0, (0, 0))
        self.workers: list[WorkerProcess] = []
        self._dir: str | None = None

    async def start(
        self,
        ctx: zmq.asyncio.Context,
        registry: SocketRegistry,
        gate: Gatekeeper,
        delivery: Delivery,
    ) -> None:
        """Start the worker processes, each with a PAIR in a private directory, and wait
        until every one has bound its ranks. Raises OSError when one fails to start (a
        start-up failure, as a bind failure in process is)."""
        cfg = self._config
        self._dir = tempfile.mkdtemp(prefix="engined-ranks-")
        for index, ranks in enumerate(split_ranks(cfg.engine.dp_size, self.processes)):
            self.workers.append(
                WorkerProcess(
                    index,
                    ranks,
                    ctx=ctx,
                    registry=registry,
                    endpoint=f"ipc://{self._dir}/worker-{index}",
                    delivery=delivery,
                    model_clock=self.model_clock,
                )
            )
        heartbeat_s = min(WORKER_HEARTBEAT_S, (self._watchdog_s or math.inf) / 4)
        started = await asyncio.gather(
            *(
                worker.start(cfg, worker_id=self._worker_id, heartbeat_s=heartbeat_s)
                for worker in self.workers
            ),
            return_exceptions=True,
        )
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        for worker in self.workers:
            assert worker.ready is not None
            for rank_ready in worker.ready.ranks:
                self.endpoints.add(
                    rank_ready.kv_endpoint, rank_ready.replay_endpoint, rank_ready.fpm_endpoint
                )
            self.handles.extend(worker.proxies[rank] for rank in worker.ranks)
            self.fpm_sinks.extend(
                RankWorkerId(worker, rank, self._worker_id) for rank in worker.ranks
            )
        ready = self.workers[0].ready
        assert ready is not None
        self.limits = RankLimits(
            ready.batch_bytes, (ready.ranks[0].kv_hwm, ready.ranks[0].replay_hwm)
        )

    @property
    def watched_publishers(self) -> list[WatchedPublisher]:
        """The proxies carry their worker's publisher counters, as of each heartbeat."""
        return [worker.proxies[rank] for worker in self.workers for rank in worker.ranks]

    def tasks(self) -> list[tuple[str, Coroutine[object, object, None]]]:
        return [(f"rank-worker-{worker.index}", worker.run()) for worker in self.workers]

    def healthy(self, max_silence_s: float) -> bool:
        """Whether every worker was heard from within `max_silence_s`."""
        return all(worker.healthy(max_silence_s) for worker in self.workers)

    async def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


RankLayout = InProcessRanks | WorkerRanks

# `rank_processes`: one worker process per available core (at most one per rank).
AUTO_RANK_PROCESSES = -1


def auto_rank_processes(dp_size: int, cores: int) -> int:
    """AUTO_RANK_PROCESSES resolved: a process per core, at most one per rank; none (the
    daemon's own loop) for a single rank or a single core, where a worker only adds a hop."""
    if dp_size == 1 or cores == 1:
        return 0
    return min(dp_size, cores)


def rank_layout(
    config: DaemonConfig, processes: int | None, *, worker_id: str, watchdog_s: float | None
) -> RankLayout:
    """In process for `processes` 0, else in min(processes, dp_size) workers;
    AUTO_RANK_PROCESSES (-1) resolved by `auto_rank_processes`, None: the config's."""
    if processes is None:
        processes = config.rank_processes
    if processes < 0:
        processes = auto_rank_processes(config.engine.dp_size, available_cores())
    if processes:
        return WorkerRanks(config, processes, worker_id=worker_id, watchdog_s=watchdog_s)
    return InProcessRanks(config, worker_id=worker_id)
