"""`wait_idle`: a `stats` reply once the named ranks are idle (PROTOCOL.md §1.1).

What a test or benchmark waiting for its workload would otherwise poll `stats` for. Idle:
nothing queued, running or parked, and every command received before it applied with its
outputs sent, so the reply comes after the last output of every request submitted before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engined.client import EngineClient, EngineError
from engined.server.reports import WAIT_IDLE_LIMIT
from tests.server.inprocess import serve
from tests.server.support import assert_idle
from tests.support import run


@asynccontextmanager
async def client_of(tmp_path: Path, **serve_args: Any) -> AsyncIterator[EngineClient]:
    """A client of an in-process daemon (tests/server/inprocess.py)."""
    async with (
        serve(tmp_path, **serve_args) as served,
        await EngineClient.connect(served.endpoint, ctx=served.ctx) as client,
    ):
        yield client


def test_the_reply_follows_every_output_of_earlier_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with client_of(tmp_path, ranks=2) as client:
            submitted = [
                await client.submit(list(range(n, n + 40)), 5 + n, dp_rank=n % 2) for n in range(8)
            ]
            stats = await client.wait_idle()
            for rank in stats.ranks:
                assert_idle(rank)
            # Every output is already queued at the client: nothing left to wait for.
            for n, request in enumerate(submitted):
                generation = await client.collect(request, timeout=0)
                assert (len(generation.token_ids), generation.finish_reason) == (
                    5 + n,
                    "length",
                )

    run(scenario())


def test_one_rank_and_an_idle_daemon(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with client_of(tmp_path, ranks=2) as client:
            assert [r.running for r in (await client.wait_idle()).ranks] == [0, 0]
            request = await client.submit(list(range(30)), 3, dp_rank=1)
            stats = await client.wait_idle(dp_rank=1)
            assert_idle(stats.ranks[1])
            assert (await client.collect(request, timeout=0)).finish_reason == "length"

    run(scenario())


def test_a_rank_out_of_range_is_refused_naming_the_field(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with client_of(tmp_path) as client:
            with pytest.raises(EngineError) as refused:
                await client.wait_idle(dp_rank=3)
            assert refused.value.code == "invalid_request"
            assert "dp_rank: 3 is out of range" in refused.value.message
            assert await client.ping()  # the daemon goes on

    run(scenario())


def test_waits_are_bounded_and_a_busy_rank_keeps_them_waiting(tmp_path: Path) -> None:
    """A paced rank whose first pass never ends (its sleep never returns) is never idle:
    WAIT_IDLE_LIMIT waits are held, the next is refused `overloaded`, and the daemon still
    answers everything else."""
    stuck = asyncio.Event()

    async def never(_: float) -> None:
        await stuck.wait()

    async def scenario() -> None:
        async with client_of(tmp_path, sleep=never, speedup_ratio=1.0) as client:
            await client.submit(list(range(30)), 50)
            waits = [
                asyncio.ensure_future(client.wait_idle(timeout=None))
                for _ in range(WAIT_IDLE_LIMIT)
            ]
            await client.ping()  # every wait has reached the daemon before this
            with pytest.raises(EngineError) as refused:
                await client.wait_idle()
            assert refused.value.code == "overloaded"
            assert f"{WAIT_IDLE_LIMIT} wait_idle" in refused.value.message
            assert not any(wait.done() for wait in waits)
            assert (await client.stats()).ranks[0].running == 1
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    run(scenario())
