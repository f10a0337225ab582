"""`n`, `logprobs` and `prompt_logprobs` through the Dynamo worker's handler, against a real
daemon (engined/dynamo/engine_outputs.py): n engine requests named and seeded as vLLM's
ParentRequest names its children, the made-up logprobs of engined.openai.logprobs by position
and choice, a 400 naming the field for what engined cannot honour, and a 400 with engined's
reason for a request the daemon rejects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engined.client import EngineClient
from engined.core.token_stream import token_bits
from engined.dynamo.handler import RequestFailed, RequestHandler
from engined.dynamo.worker_args import DisaggregationMode
from engined.openai.logprobs import position_logprobs
from tests.dynamo.test_sampling_seed import FLAGS, PROMPT, chunks, tokens, with_handler
from tests.server.daemon_harness import start_daemon
from tests.support import run

# with_handler's Limits leave the vocabulary at 1: one id to draw logprobs from.
VOCAB = 1


def body(max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "stop_conditions": {"max_tokens": max_tokens}, **fields}


def test_n_samples_are_vllms_children_streamed_by_index(tmp_path: Path) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        got = await chunks(handler, body(4, sampling_options={"n": 3}), "ctx-n")
        by_index: dict[int, list[int]] = {}
        for chunk in got:
            by_index.setdefault(chunk["index"], []).extend(chunk["token_ids"])
        for j in range(3):
            bits = token_bits(3, f"{j}_ctx-n", None, PROMPT)
            assert by_index[j] == [bits(32) for _ in range(4)]
        finals = [c for c in got if "finish_reason" in c]
        assert sorted(c["index"] for c in finals) == [0, 1, 2]
        assert finals[-1]["completion_usage"]["completion_tokens"] == 12
        assert finals[-1]["completion_usage"]["prompt_tokens"] == len(PROMPT)
        seeded = await chunks(handler, body(4, sampling_options={"n": 2, "seed": 9}), "ctx-s")
        second = [t for c in seeded if c["index"] == 1 for t in c["token_ids"]]
        direct = await client.generate(PROMPT, 4, request_id="direct", seed=10)
        assert second == direct.token_ids
        assert (await client.stats()).ranks[0].running == 0

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


def test_logprobs_ride_on_every_chunk_and_prompt_logprobs_on_the_last(tmp_path: Path) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        request = body(3, output_options={"logprobs": 0, "prompt_logprobs": 0})
        got = await chunks(handler, request, "ctx-lp")
        ids = tokens(got)
        expected = [position_logprobs(t, i, 0, key=0, vocab_size=VOCAB) for i, t in enumerate(ids)]
        assert [lp for c in got for lp in c["log_probs"]] == [p.logprob for p in expected]
        assert [top for c in got for top in c["top_logprobs"]] == [
            [{"rank": p.rank, "token_id": t, "token": None, "logprob": p.logprob}]
            for t, p in zip(ids, expected, strict=True)
        ]
        prompt = got[-1]["engine_data"]["prompt_logprobs"]
        assert len(prompt) == len(PROMPT)
        assert prompt[0] is None
        at = position_logprobs(PROMPT[1], 1 - len(PROMPT), 0, key=0, vocab_size=VOCAB)
        assert prompt[1] == {str(PROMPT[1]): {"logprob": at.logprob, "rank": at.rank}}
        assert all("engine_data" not in c for c in got[:-1])

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sampling_options": {"n": 0}}, "sampling_options.n: expected an int >= 1, got 0"),
        ({"sampling_options": {"n": "2"}}, "sampling_options.n: expected an int >= 1, got '2'"),
        (
            {"sampling_options": {"best_of": 3}},
            "sampling_options.best_of: engined does not support best_of, got 3",
        ),
        (
            {"sampling_options": {"use_beam_search": True}},
            "sampling_options.use_beam_search: engined has no beam search",
        ),
        (
            {"output_options": {"logprobs": -2}},
            "output_options.logprobs: expected an int >= 0 or -1, got -2",
        ),
        ({"output_options": [1]}, "output_options: expected a map, got [1]"),
    ],
)
def test_what_engined_cannot_honour_is_a_400_naming_it(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        with pytest.raises(RequestFailed) as refused:
            await chunks(handler, body(2, **fields), "ctx-bad")
        assert (refused.value.status, refused.value.message) == (400, message)
        assert (await client.stats()).ranks[0].running == 0

    with start_daemon(tmp_path, *FLAGS) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


def test_a_request_the_daemon_rejects_is_a_400_with_engined_s_reason(tmp_path: Path) -> None:
    # No chunked prefill and a 16-token budget: a 16-token context, and the prompt has 20.
    # (The frontend refuses such a prompt itself, from the context the worker registers; the
    # worker still answers for one that reaches the daemon.)
    budget = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "16")

    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        with pytest.raises(RequestFailed) as refused:
            await chunks(handler, body(2), "ctx-rejected")
        assert (refused.value.status, refused.value.message) == (
            400,
            "engined rejected the request: it can never be scheduled on this engine",
        )
        assert await chunks(handler, {**body(2), "token_ids": PROMPT[:8]}, "ctx-ok")
        assert (await client.stats()).ranks[0].running == 0

    with start_daemon(tmp_path, *FLAGS, *budget) as daemon:
        run(with_handler(daemon, DisaggregationMode.AGG, scenario))


def test_a_prefill_refuses_n_above_one(tmp_path: Path) -> None:
    async def scenario(handler: RequestHandler, client: EngineClient) -> None:
        with pytest.raises(RequestFailed) as refused:
            await chunks(handler, body(1, sampling_options={"n": 2}), "ctx-pd-n")
        assert refused.value.status == 400
        assert refused.value.message.startswith(
            "sampling_options.n: a prefill/decode handoff carries one sample, got n=2"
        )

    with start_daemon(tmp_path, *FLAGS, "--worker-type", "prefill") as daemon:
        run(with_handler(daemon, DisaggregationMode.PREFILL, scenario))
