"""Request ids are each client's own (issue 21: one client could squat another's ids).

Two clients may run requests of one name at once: each sees only its own, under the name it
gave, and cancels only its own. A client reusing a name it holds itself is still refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engined.client import EngineClient, EngineError
from engined.wire.control import Applied
from tests.server.daemon_harness import start_tcp_daemon


def test_two_clients_run_requests_of_one_name_each_its_own(tmp_path: Path) -> None:
    async def scenario(control: str) -> None:
        async with (
            await EngineClient.connect(control) as first,
            await EngineClient.connect(control) as second,
        ):
            a = await first.submit(list(range(40)), 3, request_id="shared")
            b = await second.submit(list(range(100, 140)), 5, request_id="shared")
            assert (a.request_id, b.request_id) == ("shared", "shared")
            streams = [
                [entry async for entry in client.outputs("shared")] for client in (first, second)
            ]
            for entries, count in zip(streams, (3, 5), strict=True):
                assert {entry.request_id for entry in entries} == {"shared"}
                assert sum(len(entry.token_ids) for entry in entries) == count
                assert entries[-1].finish_reason == "length"
            # Both ended, the name is free for either again.
            again = await second.submit(list(range(8)), 1, request_id="shared")
            assert again.request_id == "shared"
            assert [e.finish_reason async for e in second.outputs("shared")][-1] == "length"

    with start_tcp_daemon(tmp_path, "--speedup-ratio", "0") as daemon:
        asyncio.run(scenario(daemon.control))


def test_each_client_cancels_its_own_request_of_a_shared_name(tmp_path: Path) -> None:
    async def scenario(control: str) -> None:
        async with (
            await EngineClient.connect(control) as first,
            await EngineClient.connect(control) as second,
        ):
            await first.submit(list(range(40)), 100_000, request_id="shared")
            await second.submit(list(range(100, 140)), 100_000, request_id="shared")
            first_stream, second_stream = first.outputs("shared"), second.outputs("shared")
            assert (await anext(second_stream)).finish_reason is None
            assert isinstance(await second.cancel("shared"), Applied)
            assert [e.finish_reason async for e in second_stream][-1] == "cancelled"
            # The first client's request of that name runs on.
            assert (await anext(first_stream)).finish_reason is None
            assert (await anext(first_stream)).finish_reason is None
            assert isinstance(await first.cancel("shared"), Applied)
            assert [e.finish_reason async for e in first_stream][-1] == "cancelled"

    with start_tcp_daemon(tmp_path, "--speedup-ratio", "100") as daemon:
        asyncio.run(scenario(daemon.control))


def test_a_client_reusing_its_own_active_name_is_refused(tmp_path: Path) -> None:
    async def scenario(control: str) -> None:
        async with (
            await EngineClient.connect(control) as first,
            await EngineClient.connect(control) as second,
        ):
            await first.submit(list(range(40)), 100_000, request_id="mine")
            await second.submit(list(range(40)), 100_000, request_id="mine")
            for client in (first, second):
                with pytest.raises(EngineError) as refused:
                    await client.submit(list(range(8)), 1, request_id="mine")
                assert refused.value.code == "duplicate_request"
                assert refused.value.message == "request mine is already active"
                assert isinstance(await client.cancel("mine"), Applied)

    with start_tcp_daemon(tmp_path, "--speedup-ratio", "100") as daemon:
        asyncio.run(scenario(daemon.control))
