"""Handoff sessions whose coordinator goes quiet are abandoned after the session timeout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engined.client import EngineClient
from tests.server.daemon_harness import start_daemon

TIMEOUT_MS = "300"


async def wait_idle(client: EngineClient, deadline_s: float = 10.0) -> None:
    """Poll stats until the rank holds no block and queues nothing (bounded)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rank = (await client.stats()).ranks[0]
        if rank.active_blocks == 0 and rank.waiting == 0 and rank.running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"rank not idle: {(await client.stats()).ranks[0]}")


def test_held_source_is_cancelled_after_the_session_timeout(tmp_path: Path) -> None:
    """1. A prefill daemon with a 300 ms handoff session timeout.
    2. submit_handoff_prefill; its prefill completes and source_held arrives; nobody releases.
    Result: the held KV is freed by the timeout (0 active blocks), the log says "handoff
    timed out", and a late release_source is a noop.
    """

    async def scenario(control: str) -> None:
        async with await EngineClient.connect(control) as client:
            submitted = await client.submit_handoff_prefill("h1", list(range(32)), 1)
            generation = await client.collect(submitted)
            assert generation.finish_reason == "length"
            held = await client.next_lifecycle("h1", timeout=5)
            assert held.request_id == submitted.request_id
            assert (await client.stats()).ranks[0].active_blocks > 0
            await wait_idle(client)
            assert type(await client.release_source("h1")).__name__ == "Noop"

    with start_daemon(
        tmp_path,
        "--worker-type",
        "prefill",
        "--block-size",
        "4",
        "--speedup-ratio",
        "0",
        "--handoff-session-timeout-ms",
        TIMEOUT_MS,
    ) as daemon:
        asyncio.run(scenario(daemon.control))
        log = daemon.log()
    assert log.count('"handoff timed out"') == 1


def test_unactivated_destination_is_cancelled_and_its_stream_ended(tmp_path: Path) -> None:
    """1. A decode daemon with a 300 ms handoff session timeout.
    2. reserve_destination; destination_reserved arrives; nobody activates it.
    Result: the reservation is cancelled by the timeout (0 active blocks, nothing waiting),
    the destination request's stream ends with finish_reason "cancelled", and a late
    activate_destination is a noop.
    """

    async def scenario(control: str) -> None:
        async with await EngineClient.connect(control) as client:
            accepted = await client.reserve_destination("d1", list(range(32)), 4)
            reserved = await client.next_lifecycle("d1", timeout=5)
            assert reserved.request_id == accepted.request_id
            entries = [entry async for entry in client.outputs(accepted.request_id, timeout=10)]
            assert [(e.finished, e.finish_reason) for e in entries] == [(True, "cancelled")]
            await wait_idle(client)
            assert type(await client.activate_destination("d1")).__name__ == "Noop"

    with start_daemon(
        tmp_path,
        "--worker-type",
        "decode",
        "--block-size",
        "4",
        "--speedup-ratio",
        "0",
        "--handoff-session-timeout-ms",
        TIMEOUT_MS,
    ) as daemon:
        asyncio.run(scenario(daemon.control))
        log = daemon.log()
    assert log.count('"handoff timed out"') == 1


def test_activated_destination_is_not_timed_out(tmp_path: Path) -> None:
    """1. A decode daemon with a 300 ms timeout; reserve then activate a destination with a
    long output at speedup 1 (it runs past the timeout).
    Result: the request completes with all its tokens; no timeout fired.
    """

    async def scenario(control: str) -> None:
        async with await EngineClient.connect(control) as client:
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

    with start_daemon(
        tmp_path,
        "--worker-type",
        "decode",
        "--block-size",
        "4",
        "--speedup-ratio",
        "1",
        "--handoff-session-timeout-ms",
        TIMEOUT_MS,
    ) as daemon:
        asyncio.run(scenario(daemon.control))
        log = daemon.log()
    assert '"handoff timed out"' not in log
