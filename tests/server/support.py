"""Helpers shared by the server tests: a rank's stats, bounded polls of them, idleness, a
delivery that records which requests finished (for engine loops run without a server), and
a daemon served in-process just long enough to read something of the process.

Plain functions, imported as `tests.server.support` (pytest's conftest.py is for fixtures).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from engined.client import EngineClient
from engined.config import DaemonConfig, load_config
from engined.core.types import Decodes, LifecycleEvent, RequestOutput
from engined.server.daemon import EXIT_OK, Daemon
from engined.wire.control import RankStats

WAIT_S = 10.0
POLL_S = 0.005
T = TypeVar("T")


def ipc_config(tmp_path: Path, speedup: float, **flags: object) -> DaemonConfig:
    """One rank on ipc endpoints under `tmp_path`, no FPM, at `speedup`; `flags` (config keys)
    on top."""
    return load_config(
        config_path=None,
        env={},
        flags={
            "control_endpoint": f"ipc://{tmp_path}/control",
            "kv_events_endpoint": f"ipc://{tmp_path}/kv",
            "fpm_endpoint": "",
            "api_port": None,
            "engine.speedup_ratio": speedup,
            **flags,
        },
    )


async def read_while_serving(cfg: DaemonConfig, read: Callable[[], T]) -> tuple[T, T]:
    """`read()` once the daemon serves `cfg` (in this process), and again after it stopped."""
    ready = asyncio.Event()
    daemon = Daemon(cfg, on_ready=lambda _: ready.set())
    task = asyncio.create_task(daemon.serve())
    await asyncio.wait_for(ready.wait(), 30)
    serving = read()
    daemon.handle_exit(signal.SIGTERM)
    assert await asyncio.wait_for(task, 30) == EXIT_OK
    return serving, read()


async def rank0(client: EngineClient, *, timeout: float = WAIT_S) -> RankStats:
    """The stats of a single-rank daemon's only rank."""
    stats = await client.stats(timeout=timeout)
    assert len(stats.ranks) == 1
    return stats.ranks[0]


def assert_idle(stats: RankStats, total_blocks: int | None = None) -> None:
    """No active block, nothing running or waiting; with `total_blocks`, also the seed's
    `assert_scheduler_idle` (usage 0.0 and the pool size)."""
    assert (stats.active_blocks, stats.waiting, stats.running) == (0, 0, 0), stats
    if total_blocks is not None:
        assert stats.kv_cache_usage == 0.0, stats
        assert stats.total_blocks == total_blocks, stats


async def wait_for_stats(
    client: EngineClient,
    predicate: Callable[[RankStats], bool],
    what: str = "the condition",
    *,
    timeout: float = WAIT_S,
) -> RankStats:
    """Poll `stats` until `predicate` holds for rank 0; fails with the last stats at the
    deadline. (A poll interval, not synchronisation.)"""
    deadline = time.monotonic() + timeout
    while True:
        stats = await rank0(client)
        if predicate(stats):
            return stats
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout} s: {stats}")
        await asyncio.sleep(POLL_S)


class FinishedDelivery:
    """An engine loop's `Delivery` that keeps the ids of the requests that finished."""

    def __init__(self) -> None:
        self.finished: set[str] = set()

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self.finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        pass
