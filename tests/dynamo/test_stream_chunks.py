"""The Dynamo worker's chunks leave as the engine emits them (issue 26, item 5).

A chunk per engine output while Dynamo takes each one as it comes; only outputs that queued
while Dynamo had not asked for the next chunk are merged, all of them in one. The aggregated
case runs the handler against a control server with real engine loops in the test's event
loop, paced on a clock that moves only when the test says (`ManualClock`): the test decides
how many passes run before it pulls, so the chunk sizes are exact on any machine.

The decode side of a P/D pair streams from activation on: it does not wait for the prefill
daemon to answer the release of the source (a prefill daemon busy with long prompt passes
held the whole decode back, and its tokens then left in one chunk). Shown with real daemons
and the prefill one stopped (SIGSTOP) once it has handed the prompt over.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import zmq.asyncio

from engined.client import EngineClient
from engined.core.types import Decodes, RequestOutput
from engined.dynamo.handler import Limits, RequestHandler
from engined.dynamo.worker_args import DisaggregationMode
from tests.dynamo.test_sampling_seed import FLAGS, PROMPT, Context, tokens, with_handler
from tests.server.daemon_harness import start_daemon
from tests.server.inprocess import serve
from tests.server.virtual_clock import ManualClock
from tests.support import run, until

PASS_MS = 10.0


class Passes:
    """Counts the passes whose outputs the server has sent, and moves the clock pass by pass."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.delivered = 0

    def on_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self.delivered += 1

    async def run(self, count: int) -> None:
        """Let exactly `count` more passes run and their outputs leave the server: the clock
        moves a millisecond at a time, each time once the loop waits on it again."""
        for _ in range(count):
            await self._one(self.delivered + 1)

    async def _one(self, wanted: int) -> None:
        def settled() -> bool:
            return self.delivered >= wanted or self.clock.parked()

        await until(settled, "the loop to wait on the clock")
        while self.delivered < wanted:
            self.clock.advance_to(self.clock.now + 0.001)
            await until(settled, f"pass {wanted}")


def _request(max_tokens: int) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stop_conditions": {"max_tokens": max_tokens}}


async def _next(chunks: AsyncIterator[dict[str, Any]], passes: Passes) -> dict[str, Any]:
    """The next chunk, asked for before the pass that makes it runs (Dynamo keeping up)."""
    pending = asyncio.ensure_future(chunks.__anext__())
    await passes.run(1)
    return await pending


@asynccontextmanager
async def timed_handler(
    tmp_path: Path,
) -> AsyncIterator[tuple[RequestHandler, EngineClient, Passes]]:
    """A handler on a control server whose passes run only when the test says (`Passes`)."""
    clock = ManualClock()
    passes = Passes(clock)
    async with serve(
        tmp_path,
        clock=clock,
        sleep=clock.sleep,
        speedup_ratio=1.0,
        fixed_decode_ms_per_pass=PASS_MS,
        fixed_pass_overhead_ms=PASS_MS,
    ) as served:
        deliver = served.control.deliver_outputs

        def counted(rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
            deliver(rank, outputs, decodes)
            passes.on_outputs(rank, outputs, decodes)

        served.control.deliver_outputs = counted  # type: ignore[method-assign]
        ctx = zmq.asyncio.Context()
        async with await EngineClient.connect(served.endpoint, ctx=ctx) as client:

            async def connect(endpoint: str) -> EngineClient:
                return await EngineClient.connect(endpoint, ctx=ctx)

            handler = RequestHandler(
                client,
                DisaggregationMode.AGG,
                Limits(served.endpoint, 1000, 1.0),
                connect=connect,
            )
            try:
                yield handler, client, passes
            finally:
                await handler.close()
        ctx.term()


def test_chunks_follow_the_passes_and_merge_only_what_queued(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with timed_handler(tmp_path) as (handler, client, passes):
            chunks = handler.generate(_request(10), Context("ctx-timed"))
            # Taken as they come: one token a chunk, the prompt's pass included.
            taken = [await _next(chunks, passes) for _ in range(4)]
            assert [len(c["token_ids"]) for c in taken] == [1, 1, 1, 1]
            assert all("finish_reason" not in c for c in taken)
            # Three passes while nobody asks: one chunk of exactly their three tokens.
            await passes.run(3)
            await client.stats()  # replies follow the outputs sent before them
            late = await chunks.__anext__()
            assert len(late["token_ids"]) == 3
            assert "finish_reason" not in late
            # Then one a chunk again, up to the last.
            rest = [await _next(chunks, passes) for _ in range(3)]
            assert [len(c["token_ids"]) for c in rest] == [1, 1, 1]
            assert rest[-1]["finish_reason"] == "length"
            assert rest[-1]["completion_usage"]["completion_tokens"] == 10
            assert [c.get("index") for c in [*taken, late, *rest]] == [0] * 8

    run(scenario())


def test_a_stream_dropped_after_its_request_finished_leaves_no_outputs_behind(
    tmp_path: Path,
) -> None:
    """Dynamo stops reading after the first chunk; the request finishes meanwhile with its
    outputs queued, so the cancel finds nothing (`noop`): the worker drops them anyway."""

    async def scenario() -> None:
        async with timed_handler(tmp_path) as (handler, client, passes):
            chunks = handler.generate(_request(10), Context("ctx-dropped"))
            assert len((await _next(chunks, passes))["token_ids"]) == 1
            await passes.run(9)
            await client.stats()  # replies follow the outputs sent before them
            assert client.open_streams == 1
            # Dropped, as Dynamo drops a stream: its request is cancelled once the handler's
            # generators are finalised.
            await chunks.aclose()  # type: ignore[attr-defined]
            del chunks
            await until(lambda: client.open_streams == 0, "the unread outputs to be dropped")

    run(scenario())


def test_the_decode_streams_while_the_prefill_daemon_does_not_answer(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    request = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 6}}
    with (
        start_daemon(tmp_path / "p", *FLAGS, "--worker-type", "prefill") as prefill,
        start_daemon(tmp_path / "d", *FLAGS, "--worker-type", "decode") as decode,
    ):

        async def prefill_side(handler: RequestHandler, client: EngineClient) -> list[Any]:
            return [c async for c in handler.generate(request, Context("ctx-held"))]

        first = run(with_handler(prefill, DisaggregationMode.PREFILL, prefill_side))
        decode_request = {
            **request,
            "prefill_result": {
                "disaggregated_params": first[-1]["disaggregated_params"],
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }

        async def decode_side(handler: RequestHandler, client: EngineClient) -> list[Any]:
            got = [c async for c in handler.generate(decode_request, Context("ctx-held"))]
            # Streamed in full while the release still waits; the daemon answers it now.
            prefill.proc.send_signal(signal.SIGCONT)
            return got

        prefill.proc.send_signal(signal.SIGSTOP)
        try:
            got = run(with_handler(decode, DisaggregationMode.DECODE, decode_side))
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        assert len(tokens(got)) == 6
        assert got[-1]["finish_reason"] == "length"
