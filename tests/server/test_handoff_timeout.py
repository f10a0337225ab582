"""Handoff sessions whose coordinator goes quiet are abandoned after the session timeout.

In process (tests/server/inprocess.py): the control server and the rank a daemon would run,
with the daemon's default perf model, and the server's log records captured.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog

from engined.client import EngineClient
from engined.core.args import EngineArgs, WorkerType
from engined.wire.control import RankStats
from tests.server.inprocess import serve
from tests.server.support import wait_for_stats
from tests.support import run

TIMEOUT_MS = 300


def is_idle(rank: RankStats) -> bool:
    return rank.active_blocks == 0 and rank.waiting == 0 and rank.running == 0


async def wait_idle(client: EngineClient) -> None:
    """Poll stats until the rank holds no block and queues nothing (bounded)."""
    await wait_for_stats(client, is_idle, "rank idle")


@asynccontextmanager
async def worker(
    tmp_path: Path, worker_type: WorkerType, speedup_ratio: float
) -> AsyncIterator[tuple[EngineClient, list[MutableMapping[str, Any]]]]:
    """A client of an in-process worker with a 300 ms handoff session timeout (block size 4,
    the daemon's default perf model), and the log records of the whole run."""
    with structlog.testing.capture_logs() as logs:
        async with (
            serve(
                tmp_path,
                worker_type=worker_type,
                block_size=4,
                speedup_ratio=speedup_ratio,
                perf_model=EngineArgs().perf_model,
                handoff_session_timeout_ms=TIMEOUT_MS,
            ) as served,
            await EngineClient.connect(served.endpoint, ctx=served.ctx) as client,
        ):
            yield client, logs


def timeouts(logs: list[MutableMapping[str, Any]]) -> int:
    return [entry["event"] for entry in logs].count("handoff timed out")


def test_held_source_is_cancelled_after_the_session_timeout(tmp_path: Path) -> None:
    """1. A prefill worker with a 300 ms handoff session timeout.
    2. submit_handoff_prefill; its prefill completes and source_held arrives; nobody releases.
    Result: the held KV is freed by the timeout (0 active blocks), the log says "handoff
    timed out", and a late release_source is a noop.
    """

    async def scenario() -> int:
        async with worker(tmp_path, WorkerType.PREFILL, 0.0) as (client, logs):
            submitted = await client.submit_handoff_prefill("h1", list(range(32)), 1)
            generation = await client.collect(submitted)
            assert generation.finish_reason == "length"
            held = await client.next_lifecycle("h1", timeout=5)
            assert held.request_id == submitted.request_id
            assert (await client.stats()).ranks[0].active_blocks > 0
            await wait_idle(client)
            assert type(await client.release_source("h1")).__name__ == "Noop"
        return timeouts(logs)

    assert run(scenario()) == 1


def test_unactivated_destination_is_cancelled_and_its_stream_ended(tmp_path: Path) -> None:
    """1. A decode worker with a 300 ms handoff session timeout.
    2. reserve_destination; destination_reserved arrives; nobody activates it.
    Result: the reservation is cancelled by the timeout (0 active blocks, nothing waiting),
    the destination request's stream ends with finish_reason "cancelled", and a late
    activate_destination is a noop.
    """

    async def scenario() -> int:
        async with worker(tmp_path, WorkerType.DECODE, 0.0) as (client, logs):
            accepted = await client.reserve_destination("d1", list(range(32)), 4)
            reserved = await client.next_lifecycle("d1", timeout=5)
            assert reserved.request_id == accepted.request_id
            entries = [entry async for entry in client.outputs(accepted.request_id, timeout=10)]
            assert [(e.finished, e.finish_reason) for e in entries] == [(True, "cancelled")]
            await wait_idle(client)
            assert type(await client.activate_destination("d1")).__name__ == "Noop"
        return timeouts(logs)

    assert run(scenario()) == 1


def test_activated_destination_is_not_timed_out(tmp_path: Path) -> None:
    """1. A decode worker with a 300 ms timeout; reserve then activate a destination with a
    long output at speedup 1 (it runs past the timeout).
    Result: the request completes with all its tokens; no timeout fired.
    """

    async def scenario() -> int:
        async with worker(tmp_path, WorkerType.DECODE, 1.0) as (client, logs):
            accepted = await client.reserve_destination("d2", list(range(16)), 80)
            await client.next_lifecycle("d2", timeout=5)
            activated_at = time.monotonic()
            assert type(await client.activate_destination("d2")).__name__ == "Applied"
            tokens = 0
            reason = None
            async for entry in client.outputs(accepted.request_id, timeout=10):
                tokens += len(entry.token_ids)
                reason = entry.finish_reason
            assert (tokens, reason) == (80, "length")
            # 80 decode passes of >= 5.7 ms each: the request outlived the session timeout.
            assert time.monotonic() - activated_at > 0.3
        return timeouts(logs)

    assert run(scenario()) == 0
