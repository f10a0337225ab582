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
from engined.core.args import PerfModelKind
from engined.server.control.reports import WAIT_IDLE_CLIENT_LIMIT, WAIT_IDLE_LIMIT
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


async def read_by_the_daemon(client: EngineClient) -> None:
    """Return once every message the client's started tasks were sending has been read: the
    first ping's round trip lets those tasks send, the second follows them on the socket."""
    await client.ping()
    await client.ping()


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
    WAIT_IDLE_LIMIT waits are held (from as many clients as that takes), the next is refused
    `overloaded`, and the daemon still answers everything else."""
    stuck = asyncio.Event()

    async def never(_: float) -> None:
        await stuck.wait()

    async def scenario() -> None:
        # Passes of a modeled second: the first pass's end is ahead of the clock however
        # late it ran, so its (never-ending) wait is reached; with short passes a loaded
        # machine lets a late rank catch up its schedule without waiting (engine_loop).
        async with serve(
            tmp_path,
            sleep=never,
            speedup_ratio=1.0,
            perf_model=PerfModelKind.FIXED,
            fixed_pass_overhead_ms=1000.0,
        ) as served:
            clients = [
                await EngineClient.connect(served.endpoint, ctx=served.ctx)
                for _ in range(WAIT_IDLE_LIMIT // WAIT_IDLE_CLIENT_LIMIT + 1)
            ]
            *waiters, last = clients
            await last.submit(list(range(30)), 50)
            waits = [
                asyncio.ensure_future(client.wait_idle(timeout=None))
                for client in waiters
                for _ in range(WAIT_IDLE_CLIENT_LIMIT)
            ]
            assert len(waits) == WAIT_IDLE_LIMIT
            for client in waiters:
                await read_by_the_daemon(client)
            with pytest.raises(EngineError) as refused:
                await last.wait_idle()
            assert refused.value.code == "overloaded"
            assert refused.value.message == "1024 wait_idle messages are already waiting"
            assert not any(wait.done() for wait in waits)
            assert (await last.stats()).ranks[0].running == 1
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            for client in clients:
                await client.close()

    run(scenario())


def test_one_client_cannot_fill_the_room_of_another(tmp_path: Path) -> None:
    """One client holds at most WAIT_IDLE_CLIENT_LIMIT waits; past them it alone is refused,
    another client's wait is still held, and once the rank is idle every wait is answered
    and nothing is kept for either client."""
    stuck = asyncio.Event()

    async def held(_: float) -> None:
        await stuck.wait()

    async def scenario() -> None:
        # A clock that never moves: every pass's end is ahead of it, so the held wait is
        # reached however late the pass ran (a late pass does not wait, engine_loop).
        async with (
            serve(tmp_path, clock=lambda: 0.0, sleep=held, speedup_ratio=1.0) as served,
            await EngineClient.connect(served.endpoint, ctx=served.ctx) as hog,
            await EngineClient.connect(served.endpoint, ctx=served.ctx) as bystander,
        ):
            await hog.submit(list(range(30)), 5)
            hogged = [
                asyncio.ensure_future(hog.wait_idle(timeout=None))
                for _ in range(WAIT_IDLE_CLIENT_LIMIT)
            ]
            await read_by_the_daemon(hog)
            with pytest.raises(EngineError) as refused:
                await hog.wait_idle()
            assert refused.value.code == "overloaded"
            assert refused.value.message == (
                "this client has 64 wait_idle messages waiting already"
            )
            mine = asyncio.ensure_future(bystander.wait_idle(timeout=None))
            await read_by_the_daemon(bystander)  # a refusal would have come before
            assert not mine.done() and not any(wait.done() for wait in hogged)
            assert served.control.client_state()["idle_waiting"] == 2
            stuck.set()
            for stats in await asyncio.gather(mine, *hogged):
                assert_idle(stats.ranks[0])
            assert served.control.client_state()["idle_waiting"] == 0

    run(scenario())
