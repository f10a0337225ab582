"""A real daemon under `--async-scheduling` streams the same tokens as one without it.

Both daemons get the same 20 requests at once, with the same `--seed`, in a pool small
enough that they preempt each other. Tokens depend only on the seed, the request and the
position, so async scheduling (outputs one pass later, placeholders scheduled, stale output
of a preempted request delivered) may change when tokens arrive, never which, nor how many,
nor how a request ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq.asyncio

from engined.client import EngineClient
from engined.core.types import FinishReason
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import run

COMMON = (
    "--seed",
    "5",
    "--speedup-ratio",
    "0",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--num-gpu-blocks",
    "24",
)
PROMPTS = [[n * 100 + i for i in range(3 + n % 7)] for n in range(20)]
MAX_TOKENS = 24


async def generate_all(daemon: DaemonProcess) -> tuple[dict[str, tuple[list[int], str]], int]:
    """(tokens and finish reason by request id, preemptions) of one daemon."""
    ctx = zmq.asyncio.Context()
    try:
        async with await EngineClient.connect(daemon.control, ctx=ctx) as client:
            done = await asyncio.gather(
                *(client.generate(p, MAX_TOKENS, request_id=f"r{n}") for n, p in enumerate(PROMPTS))
            )
            stats = await client.stats()
            preemptions = sum(rank.preemptions_total for rank in stats.ranks)
            return {g.request_id: (g.token_ids, str(g.finish_reason)) for g in done}, preemptions
    finally:
        ctx.term()


def test_async_scheduling_streams_the_same_tokens_as_the_synchronous_scheduler(
    tmp_path: Path,
) -> None:
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    with (
        start_daemon(tmp_path / "sync", *COMMON) as plain,
        start_daemon(tmp_path / "async", *COMMON, "--async-scheduling") as asynchronous,
    ):
        sync_tokens, sync_preemptions = run(generate_all(plain))
        async_tokens, async_preemptions = run(generate_all(asynchronous))
    assert sync_preemptions > 0 and async_preemptions > 0
    assert sorted(async_tokens) == sorted(f"r{n}" for n in range(20))
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in async_tokens.values())
    assert {reason for _, reason in async_tokens.values()} == {str(FinishReason.LENGTH)}
    assert async_tokens == sync_tokens
