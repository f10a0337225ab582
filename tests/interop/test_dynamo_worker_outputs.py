"""`n`, `logprobs` and `echo` through a real Dynamo 1.6.1 frontend and `engined dynamo-worker`.

The frontend hands the worker `sampling_options.n` / `best_of` and `output_options.logprobs`
(completions' `logprobs`, chat's `top_logprobs`); `echo` arrives as `prompt_logprobs: 1`. The
worker answers as dynamo.vllm does (engined/dynamo/engine_outputs.py): n choices by index,
the made-up logprobs of `engined.openai.logprobs` keyed by the choice's index, and a 400
naming the field for what it cannot honour. The tiny model's words are one token each ("wN"
is id N + 3), so the expected values follow from the text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import pytest

from engined.openai.logprobs import position_logprobs
from tests.interop.dynamo_cluster import (
    Frontend,
    OpenAIError,
    chat,
    completions,
    dynamo_cluster,
    stream_usage,
)
from tests.interop.dynamo_worker_support import FAST_ARGS, add_worker, wait_routable
from tests.interop.peers import require_peers
from tests.interop.tiny_model import FIRST_WORD_ID, words

VOCAB_SIZE: Final = 1000
MODEL: Final = "tiny-outputs"


@dataclass
class Served:
    frontend: Frontend


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python = require_peers()
    with dynamo_cluster(python, tmp_path_factory.mktemp("dynamo-outputs")) as cluster:
        frontend = cluster.frontend(router_mode="kv")
        daemon = cluster.engined_daemon(*FAST_ARGS, "--port", "", name="outputs-engined")
        worker = add_worker(cluster, daemon, name="outputs-worker", model=MODEL, namespace="dynamo")
        assert worker.instance_id is not None
        wait_routable(frontend, [worker.instance_id])
        yield Served(frontend)
        codes = cluster.close()
    assert set(codes.values()) == {0}, codes


def text_ids(text: str) -> list[int]:
    return [int(w[1:]) + FIRST_WORD_ID for w in text.split()]


def expected_logprobs(
    ids: list[int], k: int, index: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    at = [position_logprobs(t, i, k, key=index, vocab_size=VOCAB_SIZE) for i, t in enumerate(ids)]
    return [(p.logprob, p.entries) for p in at]


def test_n_choices_come_back_by_index(served: Served) -> None:
    reply = completions(served.frontend, words(5), model=MODEL, max_tokens=3, n=2)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    texts = [c["text"] for c in reply["choices"]]
    assert [len(t.split()) for t in texts] == [3, 3]
    assert texts[0] != texts[1]
    assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
    assert reply["usage"]["prompt_tokens"] == 5
    assert reply["usage"]["completion_tokens"] == 6

    chunks = chat(served.frontend, words(5), model=MODEL, max_tokens=2, n=3, stream=True)
    by_index: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                by_index.setdefault(choice["index"], []).extend(content.split())
    assert sorted(by_index) == [0, 1, 2]
    assert all(len(w) == 2 for w in by_index.values())
    usage = stream_usage(chunks)
    assert usage is not None
    assert usage["completion_tokens"] == 6


def test_completion_logprobs_are_engineds_made_up_ones(served: Served) -> None:
    reply = completions(served.frontend, words(5, start=40), model=MODEL, max_tokens=3, logprobs=2)
    (choice,) = reply["choices"]
    logprobs = choice["logprobs"]
    tokens = choice["text"].split()
    assert logprobs["tokens"] == tokens
    expected = expected_logprobs(text_ids(choice["text"]), 2, 0)
    assert logprobs["token_logprobs"] == pytest.approx([lp for lp, _ in expected])
    for top, (_, entries) in zip(logprobs["top_logprobs"], expected, strict=True):
        want = {f"w{token - FIRST_WORD_ID}": lp for token, lp in entries}
        assert top == pytest.approx(want, rel=1e-6)


def test_chat_logprobs_stream_per_chunk(served: Served) -> None:
    chunks = chat(
        served.frontend,
        words(4, start=60),
        model=MODEL,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    content = [
        item
        for chunk in chunks
        for choice in chunk.get("choices") or ()
        for item in ((choice.get("logprobs") or {}).get("content") or ())
    ]
    assert len(content) == 3
    ids = [item["token_id"] for item in content]
    expected = expected_logprobs(ids, 2, 0)
    for item, (lp, entries) in zip(content, expected, strict=True):
        assert item["token"] == f"w{item['token_id'] - FIRST_WORD_ID}"
        assert item["logprob"] == pytest.approx(lp)
        tops = [(t["token"], t["logprob"]) for t in item["top_logprobs"]]
        # As vLLM's chat API: the first k of the sampled-first list.
        assert [t for t, _ in tops] == [f"w{token - FIRST_WORD_ID}" for token, _ in entries[:2]]
        assert [v for _, v in tops] == pytest.approx([v for _, v in entries[:2]])


def test_best_of_is_a_400_naming_it(served: Served) -> None:
    with pytest.raises(OpenAIError) as refused:
        completions(served.frontend, words(3), model=MODEL, max_tokens=2, best_of=2)
    assert refused.value.status == 400
    assert "sampling_options.best_of: engined does not support best_of, got 2" in str(refused.value)


def test_echo_reaches_the_worker_as_prompt_logprobs_and_the_frontend_renders_none(
    served: Served,
) -> None:
    """Dynamo 1.6.1 turns `echo` into `prompt_logprobs: 1` and renders neither the prompt
    nor its logprobs into a completion, for any backend; the worker attaches them as
    dynamo.vllm does and the reply is the generated text alone."""
    reply = completions(served.frontend, words(3, start=80), model=MODEL, max_tokens=2, echo=True)
    (choice,) = reply["choices"]
    assert len(choice["text"].split()) == 2
    assert reply["usage"]["prompt_tokens"] == 3
