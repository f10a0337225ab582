"""The handler's gate and rank pinning (what `gated` and `RankWorker.generate` did around it).

A gate that is not serving refuses a request with its refusal before anything reaches the
daemon; a serving one lets it through. A `--worker-per-rank` handler sends every request to
its own rank, whatever the request's routing named. The handler runs against an in-process
control server (no Dynamo runtime: a context is anything with `id()` and
`async_killed_or_stopped()`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from engined.client import EngineClient
from engined.dynamo.handler import Limits, RequestHandler
from engined.dynamo.request_fields import pin_rank
from engined.dynamo.worker_args import DisaggregationMode
from tests.dynamo.test_sampling_seed import PROMPT, Context
from tests.server.inprocess import serve
from tests.support import run


class Gone(Exception):
    """The refusal of the test's gate (the worker's is Dynamo's EngineShutdown)."""


class Gate:
    def __init__(self, serving: bool) -> None:
        self.serving = serving
        self.refused: list[Gone] = []

    def refusal(self) -> Exception:
        self.refused.append(Gone("the daemon is gone"))
        return self.refused[-1]


def _request(routing: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 3}, "routing": routing}


def test_a_closed_gate_refuses_before_the_daemon_and_an_open_one_serves_the_pinned_rank(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with serve(tmp_path, ranks=2, speedup_ratio=0.0) as served:
            ctx = zmq.asyncio.Context()
            async with await EngineClient.connect(served.endpoint, ctx=ctx) as client:

                async def connect(endpoint: str) -> EngineClient:
                    return await EngineClient.connect(endpoint, ctx=ctx)

                limits = Limits(served.endpoint, 1000, 0.0)
                handler = RequestHandler(
                    client, DisaggregationMode.AGG, limits, connect=connect, rank=1
                )
                closed = Gate(serving=False)
                handler.gate = closed
                refused = _request({"dp_rank": 0})
                with pytest.raises(Gone) as caught:
                    await anext(handler.generate(refused, Context("ctx-refused")))
                assert [caught.value] == closed.refused
                assert refused["routing"] == {"dp_rank": 0}
                assert handler.in_flight == 0
                assert [r.passes_total for r in (await client.stats()).ranks] == [0, 0]

                handler.gate = Gate(serving=True)
                served_request = _request({"dp_rank": 0})
                got = [c async for c in handler.generate(served_request, Context("ctx-served"))]
                # How the three tokens group into chunks is the consumer's pace (merging).
                assert sum(len(c["token_ids"]) for c in got) == 3
                assert got[-1]["finish_reason"] == "length"
                assert served_request["routing"] == {"dp_rank": 1}
                # The prompt's pass makes the first token, a decode pass each of the others.
                assert [r.passes_total for r in (await client.stats()).ranks] == [0, 3]
                await handler.close()
            ctx.term()

    run(scenario())


@pytest.mark.parametrize(
    ("request_", "pinned"),
    [
        ({}, {"routing": {"dp_rank": 3}}),
        ({"routing": None}, {"routing": {"dp_rank": 3}}),
        ({"routing": {"dp_rank": 0, "x": 1}}, {"routing": {"dp_rank": 3, "x": 1}}),
        ({"routing": {"dp_rank": 3}}, {"routing": {"dp_rank": 3}}),
    ],
)
def test_pin_rank_routes_to_the_served_rank_whatever_was_named(
    request_: dict[str, Any], pinned: dict[str, Any]
) -> None:
    pin_rank(request_, 3)
    assert request_ == pinned
