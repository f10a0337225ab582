"""A started daemon has frozen its start-up heap (`engined.server.ranks.freeze_startup_heap`).

Full collections then skip everything built at start-up, as vLLM's engine core arranges
with `gc.freeze()`: the long pauses they caused were the largest pass-start lateness seen.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from pathlib import Path

from engined.config import load_config
from engined.server.daemon import EXIT_OK, Daemon
from tests.support import run


def test_the_start_up_heap_is_frozen_once_the_daemon_serves(tmp_path: Path) -> None:
    config = load_config(
        config_path=None,
        env={},
        flags={
            "control_endpoint": f"ipc://{tmp_path}/control",
            "kv_events_endpoint": f"ipc://{tmp_path}/kv",
            "fpm_endpoint": "",
            "engine.speedup_ratio": 0,
        },
    )

    async def scenario() -> None:
        gc.unfreeze()
        ready = asyncio.Event()
        daemon = Daemon(config, on_ready=lambda _: ready.set())
        task = asyncio.create_task(daemon.serve())
        try:
            await asyncio.wait_for(ready.wait(), 30)
            assert gc.get_freeze_count() > 0
        finally:
            daemon.handle_exit(signal.SIGTERM)
            assert await asyncio.wait_for(task, 30) == EXIT_OK
            gc.unfreeze()

    run(scenario())
