"""The Dynamo worker forwards `stop_conditions.stop_token_ids_hidden` and `min_tokens`.

As dynamo.vllm hands them to vLLM's `SamplingParams`: a request ends `"stop"` (one of
Dynamo's finish reasons) on the first hidden stop id it generates once it has `min_tokens`,
the id included; before `min_tokens` a stop id is never drawn. The handler runs against real
daemons, as in test_sampling_seed.py, so the tokens are the request's seeded stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engined.client import EngineClient
from engined.core.token_stream import token_bits
from engined.dynamo.handler import RequestFailed, RequestHandler
from engined.dynamo.worker_args import DisaggregationMode
from tests.dynamo.test_sampling_seed import FLAGS, PROMPT, chunks, tokens, with_handler
from tests.server.daemon_harness import start_daemon
from tests.support import run


def body(max_tokens: int, **stop: Any) -> dict[str, Any]:
    return {
        "token_ids": PROMPT,
        "stop_conditions": {"max_tokens": max_tokens, **stop},
        "sampling_options": {"seed": 5},
    }


def test_a_hidden_stop_id_ends_the_stream_with_stop(tmp_path: Path) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        free = tokens(await chunks(handler, body(13), "ctx-free"))
        stop_id = free[3]
        got = await chunks(handler, body(12, stop_token_ids_hidden=[stop_id]), "ctx-stop")
        assert tokens(got) == free[:4]
        assert got[-1]["finish_reason"] == "stop"
        assert got[-1]["completion_usage"]["completion_tokens"] == 4
        # Before min_tokens the stop id is drawn again: the stream skips that one draw.
        held = await chunks(
            handler, body(12, stop_token_ids_hidden=[stop_id], min_tokens=5), "ctx-min"
        )
        assert tokens(held) == free[:3] + free[4:13]
        assert held[-1]["finish_reason"] == "length"

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (
            {"stop_token_ids_hidden": "7"},
            "stop_conditions.stop_token_ids_hidden: expected token ids, got '7'",
        ),
        (
            {"stop_token_ids_hidden": [7, -1]},
            "stop_conditions.stop_token_ids_hidden: expected token ids, got [7, -1]",
        ),
        ({"min_tokens": "2"}, "stop_conditions.min_tokens: expected an int >= 0, got '2'"),
        (
            {"stop_token_ids_hidden": list(range(257))},
            "engined invalid_request: Expected `array` of length <= 256 - at "
            "`$.request.stop_token_ids`",
        ),
    ],
)
def test_malformed_stop_conditions_are_a_400_naming_them(
    tmp_path: Path, stop: dict[str, Any], message: str
) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        with pytest.raises(RequestFailed) as refused:
            await chunks(handler, body(4, **stop), "ctx-bad")
        assert (refused.value.status, refused.value.message) == (400, message)
        assert (await client.stats()).ranks[0].running == 0

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


def test_the_decode_worker_stops_on_a_hidden_stop_id(tmp_path: Path) -> None:
    """The prefill's token is the sequence's first; the decode side stops on its 5th."""
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    bits = token_bits(3, "ctx-pd", None, PROMPT)
    expected = [bits(32) for _ in range(8)]
    request = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 8}}
    with (
        start_daemon(tmp_path / "p", *FLAGS, "--worker-type", "prefill") as p,
        start_daemon(tmp_path / "d", *FLAGS, "--worker-type", "decode") as d,
    ):

        async def prefill(handler: RequestHandler, client: EngineClient) -> list[Any]:
            return await chunks(handler, request, "ctx-pd")

        first = run(with_handler(p, DisaggregationMode.PREFILL, prefill))
        decode_request = {
            "token_ids": PROMPT,
            "stop_conditions": {"max_tokens": 8, "stop_token_ids_hidden": [expected[4]]},
            "prefill_result": {
                "disaggregated_params": first[-1]["disaggregated_params"],
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }

        async def decode(handler: RequestHandler, client: EngineClient) -> list[Any]:
            return await chunks(handler, decode_request, "ctx-pd")

        got = run(with_handler(d, DisaggregationMode.DECODE, decode))
        assert tokens(got) == expected[:5]
        assert got[-1]["finish_reason"] == "stop"


def test_the_prefill_worker_caps_the_clients_min_tokens(tmp_path: Path) -> None:
    """Dynamo's PrefillRouter sends `max_tokens` 1 with the client's `min_tokens`; the
    prefill makes its one token all the same, as dynamo.vllm caps both to 1."""
    request = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 1, "min_tokens": 64}}

    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        got = await chunks(handler, request, "ctx-prefill-min")
        assert len(tokens(got)) == 1
        assert got[-1]["finish_reason"] == "length"
        assert "engined" in got[-1]["disaggregated_params"]

    with start_daemon(tmp_path, *FLAGS, "--worker-type", "prefill") as daemon:
        run(with_handler(daemon, DisaggregationMode.PREFILL, scenario))
