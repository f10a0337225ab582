"""The Dynamo harness itself: a real frontend (`--router-mode kv`) and one `dynamo.mocker`
worker (block size 16) serve the tiny model over the OpenAI API on the loopback.

One frontend and one mocker for the whole module (a module-scoped fixture); every test uses
prompts of its own words so that no test sees another's cached blocks.

What Dynamo 1.6.1 does here, and what the tests pin:
- `/v1/models` lists the model once the worker's card is discovered; the frontend's `/health`
  lists the worker's `generate` instance, whose id is the `worker_id` of the route lines.
- The mocker caps a prefix hit at prompt_len - 1 tokens in whole blocks: a 128-token prompt
  sent twice reports `usage.prompt_tokens_details.cached_tokens` 0 (present, not absent), then
  112. The KV router's `overlap_blocks` counts whole prompt blocks from the mocker's KV events:
  0 the first time, 8 once the events reached the frontend (asynchronously: polled).
- The mocker's output ids are outside the tiny vocabulary (1000..1999), so texts are "" and
  token deltas vanish from streams unless `nvext.extra_fields=["completion_token_ids"]`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.interop.dynamo_cluster import (
    TOKEN_IDS_NVEXT,
    DynamoCluster,
    Frontend,
    MockerWorker,
    chat,
    chunk_token_ids,
    completions,
    dynamo_cluster,
    stream_usage,
)
from tests.interop.peers import require_peers
from tests.interop.tiny_model import words

BLOCK_SIZE = 16
MODEL = "tiny"
ROUTE_SYNC_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Setup:
    cluster: DynamoCluster
    frontend: Frontend
    mocker: MockerWorker


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    python = require_peers()
    with dynamo_cluster(python, tmp_path_factory.mktemp("dynamo-mocker")) as cluster:
        frontend = cluster.frontend(router_mode="kv")
        mocker = cluster.mocker(block_size=BLOCK_SIZE)
        yield Setup(cluster, frontend, mocker)
        codes = cluster.close()
    assert codes == {"mocker": 0, "frontend": 0}, (
        f"SIGTERM exit codes {codes}\n{cluster.describe()}"
    )


def test_models_lists_the_tiny_model(setup: Setup) -> None:
    frontend, mocker = setup.frontend, setup.mocker
    assert frontend.models() == [MODEL], setup.cluster.describe()
    assert mocker.instance_id is not None
    assert frontend.has_instance(
        mocker.instance_id, namespace="dynamo", component="backend", endpoint="generate"
    ), frontend.instances()


def test_completion_returns_max_tokens(setup: Setup) -> None:
    frontend = setup.frontend
    reply = completions(frontend, words(20, start=0), model=MODEL, max_tokens=4)
    usage = reply["usage"]
    assert usage["completion_tokens"] == 4, reply
    assert usage["prompt_tokens"] == 20, reply  # one id per word, nothing added
    assert reply["choices"][0]["finish_reason"] == "length", reply
    (route,) = frontend.wait_route(reply)
    assert route.worker_id == setup.mocker.instance_id, route
    assert (route.phase, route.outcome, route.overlap_blocks) == ("Aggregated", "success", 0)


def test_second_identical_prompt_hits_the_cache(setup: Setup) -> None:
    frontend = setup.frontend
    prompt = words(128, start=100)
    first = completions(frontend, prompt, model=MODEL, max_tokens=4)
    second = completions(frontend, prompt, model=MODEL, max_tokens=4)
    assert first["usage"]["prompt_tokens"] == 128, first
    # Present and 0 on a miss; the hit stops a block short of the whole prompt (127 tokens
    # may be reused, in whole 16-token blocks: 112).
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 112, second
    assert second["usage"]["completion_tokens"] == 4, second

    (route,) = frontend.wait_route(first)
    assert (route.overlap_blocks, route.worker_id) == (0, setup.mocker.instance_id), route
    # The router learns the blocks from the mocker's KV events, asynchronously: repeat the
    # prompt until a route reports all 8 of its blocks (a deadline, no sleep).
    deadline = time.monotonic() + ROUTE_SYNC_TIMEOUT_S
    overlaps = [frontend.wait_route(second)[0].overlap_blocks]
    while overlaps[-1] != 128 // BLOCK_SIZE:
        assert time.monotonic() < deadline, f"overlaps {overlaps}\n{frontend.describe()}"
        again = completions(frontend, prompt, model=MODEL, max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 112, again
        overlaps.append(frontend.wait_route(again)[0].overlap_blocks)
    assert set(overlaps) <= {0, 8}, overlaps


def test_streaming_completion_has_a_chunk_per_token(setup: Setup) -> None:
    chunks = completions(
        setup.frontend,
        words(24, start=300),
        model=MODEL,
        max_tokens=5,
        stream=True,
        nvext=TOKEN_IDS_NVEXT,
    )
    per_chunk = [chunk_token_ids(c) for c in chunks if chunk_token_ids(c)]
    assert [len(ids) for ids in per_chunk] == [1] * 5, chunks
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finish == ["length"], chunks
    usage = stream_usage(chunks)
    assert usage is not None, chunks
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (24, 5), usage


def test_chat_completions_apply_the_template(setup: Setup) -> None:
    frontend = setup.frontend
    reply = chat(frontend, words(3, start=400), model=MODEL, max_tokens=3)
    # The template is BOS + the message contents: 1 + 3 prompt tokens.
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) == (4, 3)
    assert reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["choices"][0]["message"]["role"] == "assistant", reply

    chunks = chat(
        frontend,
        words(3, start=410),
        model=MODEL,
        max_tokens=3,
        stream=True,
        nvext=TOKEN_IDS_NVEXT,
    )
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", chunks
    assert sum(len(chunk_token_ids(c)) for c in chunks) == 3, chunks
    usage = stream_usage(chunks)
    assert usage is not None and usage["completion_tokens"] == 3, chunks
