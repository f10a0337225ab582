"""The Dynamo worker passes `sampling_options.seed` through, and refuses a malformed one.

The handler runs against real daemons (no Dynamo runtime needed: a context is anything with
`id()` and `async_killed_or_stopped()`). A seeded request gets the same tokens under any
context id, the tokens an engined client gets for that seed; without a seed the decode side of
a P/D pair emits the tokens the engine seed and the context id give, the prefill's included.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from engined.client import EngineClient
from engined.core.token_stream import token_bits
from engined.dynamo.handler import Limits, RequestFailed, RequestHandler
from engined.dynamo.worker_args import DisaggregationMode
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import run

PROMPT = list(range(40, 60))
FLAGS = ("--seed", "3", "--speedup-ratio", "0", "--block-size", "4", "--drain-timeout", "2")


class Context:
    def __init__(self, request_id: str) -> None:
        self._id = request_id

    def id(self) -> str:
        return self._id

    async def async_killed_or_stopped(self) -> None:
        await asyncio.Event().wait()


def body(max_tokens: int, sampling: Any = None) -> dict[str, Any]:
    request: dict[str, Any] = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": max_tokens}}
    if sampling is not None:
        request["sampling_options"] = sampling
    return request


async def chunks(handler: RequestHandler, request: dict[str, Any], ctx_id: str) -> list[Any]:
    return [chunk async for chunk in handler.generate(request, Context(ctx_id))]


def tokens(got: list[Any]) -> list[int]:
    return [token for chunk in got for token in chunk["token_ids"]]


async def with_handler(daemon: DaemonProcess, mode: DisaggregationMode, scenario: Any) -> Any:
    ctx = zmq.asyncio.Context()
    try:
        async with await EngineClient.connect(daemon.control, ctx=ctx) as client:

            async def connect(endpoint: str) -> EngineClient:
                return await EngineClient.connect(endpoint, ctx=ctx)

            limits = Limits(daemon.control, 1000, 0.0)
            handler = RequestHandler(client, mode, limits, connect=connect)
            try:
                return await scenario(handler, client)
            finally:
                await handler.close()
    finally:
        ctx.term()


def test_a_sampling_seed_keys_the_tokens_whatever_the_context(tmp_path: Path) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        first = tokens(await chunks(handler, body(6, {"seed": 5, "temperature": 0.7}), "ctx-a"))
        again = tokens(await chunks(handler, body(6, {"seed": 5}), "ctx-b"))
        direct = await client.generate(PROMPT, 6, request_id="direct", seed=5)
        unseeded = tokens(await chunks(handler, body(6, {"seed": None}), "ctx-c"))
        assert first == again == direct.token_ids
        assert len(first) == 6
        bits = token_bits(3, "ctx-c", None, PROMPT)
        assert unseeded == [bits(32) for _ in range(6)]
        assert unseeded != first

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"seed": "5"}, "sampling_options.seed: expected an int64 or null, got '5'"),
        ({"seed": 1.5}, "sampling_options.seed: expected an int64 or null, got 1.5"),
        ({"seed": True}, "sampling_options.seed: expected an int64 or null, got True"),
        (
            {"seed": 2**63},
            "sampling_options.seed: expected an int64 or null, got 9223372036854775808",
        ),
        (
            {"seed": -(2**63) - 1},
            "sampling_options.seed: expected an int64 or null, got -9223372036854775809",
        ),
        ([1, 2], "sampling_options: expected a map, got [1, 2]"),
    ],
)
def test_a_malformed_seed_is_a_400_naming_it(tmp_path: Path, sampling: Any, message: str) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        with pytest.raises(RequestFailed) as refused:
            await chunks(handler, body(4, sampling), "ctx-bad")
        assert (refused.value.status, refused.value.message) == (400, message)
        assert (await client.stats()).ranks[0].running == 0

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


def test_the_decode_worker_continues_the_prefill_workers_sequence(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    expected_bits = token_bits(3, "ctx-pd", None, PROMPT)
    expected = [expected_bits(32) for _ in range(8)]
    with (
        start_daemon(tmp_path / "p", *FLAGS, "--worker-type", "prefill") as p,
        start_daemon(tmp_path / "d", *FLAGS, "--worker-type", "decode") as d,
    ):

        async def prefill(handler: RequestHandler, client: EngineClient) -> list[Any]:
            return await chunks(handler, body(8), "ctx-pd")

        first = run(with_handler(p, DisaggregationMode.PREFILL, prefill))
        assert tokens(first) == expected[:1]
        decode_request = body(8) | {
            "prefill_result": {
                "disaggregated_params": first[-1]["disaggregated_params"],
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        }

        async def decode(handler: RequestHandler, client: EngineClient) -> list[Any]:
            return await chunks(handler, decode_request, "ctx-pd")

        assert tokens(run(with_handler(d, DisaggregationMode.DECODE, decode))) == expected
