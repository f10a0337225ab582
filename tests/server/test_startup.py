"""What a daemon does once it serves: it has frozen its start-up heap, and logged its bounds.

Full collections skip everything built at start-up, as vLLM's engine core arranges with
`gc.freeze()` (`engined.server.ranks.rank_build.freeze_startup_heap`): the long pauses they caused
were the largest pass-start lateness seen. The "engined started" line carries the bounds in force
(`engined.server.ops.startup_log`), so an operator reads them from the journal.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

import engined.core
from engined.config import DaemonConfig
from engined.server.daemon import EXIT_OK, Daemon
from tests.server.support import ipc_config
from tests.support import run


def config(tmp_path: Path) -> DaemonConfig:
    return ipc_config(
        tmp_path,
        0,
        kv_replay_endpoint=f"ipc://{tmp_path}/replay",
        max_queued_requests=77,
        max_num_queued_tokens=4096,
    )


async def serving(cfg: DaemonConfig) -> tuple[Daemon, asyncio.Task[int]]:
    ready = asyncio.Event()
    daemon = Daemon(cfg, on_ready=lambda _: ready.set())
    task = asyncio.create_task(daemon.serve())
    await asyncio.wait_for(ready.wait(), 30)
    return daemon, task


async def stopped(daemon: Daemon, task: asyncio.Task[int]) -> None:
    daemon.handle_exit(signal.SIGTERM)
    assert await asyncio.wait_for(task, 30) == EXIT_OK


def test_the_start_up_log_names_the_bounds_in_force(tmp_path: Path) -> None:
    async def scenario() -> list[MutableMapping[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            daemon, task = await serving(config(tmp_path))
            await stopped(daemon, task)
        return [e for e in logs if e["event"] == "engined started"]

    (started,) = run(scenario())
    assert started["core"] == engined.core.build()
    limits = started["limits"]
    assert isinstance(limits, dict)
    assert limits["max_queued_requests"] == 77
    assert (limits["max_num_queued_reqs"], limits["max_num_queued_tokens"]) == (None, 4096)
    # Derived from the pool (engined.server.control.budgets): 16,384 blocks of 64 tokens, a prompt
    # of them all and as many planned ids at 5 bytes each, 1 KiB of ids, 1 MiB of margin.
    assert limits["control_max_message_bytes"] == 2 * 16384 * 64 * 5 + 1024 + 1024 * 1024
    assert limits["control_inflight_bytes"] == 256 * 1024 * 1024
    assert limits["control_unread_bytes"] == 64 * 1024 * 1024
    assert limits["kv_events_buffer_bytes"] == 64 * 1024 * 1024
    assert limits["kv_replay_client_bytes"] == 8 * 1024 * 1024
    assert set(limits) == {
        "max_queued_requests",
        "max_num_queued_reqs",
        "max_num_queued_tokens",
        "control_max_message_bytes",
        "control_inflight_bytes",
        "control_unread_bytes",
        "kv_batch_bytes_max",
        "kv_events_buffer_bytes",
        "kv_events_hwm",
        "kv_replay_client_bytes",
        "kv_replay_hwm",
    }
    engine = started["engine"]
    assert isinstance(engine, dict)
    assert (engine["engine_type"], engine["dp_size"], engine["speedup_ratio"]) == ("vllm", 1, 0.0)


def test_the_start_up_heap_is_frozen_once_the_daemon_serves(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def scenario() -> None:
        gc.unfreeze()
        daemon, task = await serving(cfg)
        try:
            assert gc.get_freeze_count() > 0
        finally:
            await stopped(daemon, task)
            gc.unfreeze()

    run(scenario())
