"""`truncate_prompt_tokens` as vLLM 0.33 applies it: the prompt cut before the engine sees it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engined.openai.tokenizer import load_tokenizer
from tests.openai.api_harness import start_api

PROMPT = list(range(100, 110))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp: Path = tmp_path_factory.mktemp("truncation")
    with (
        start_api(tmp, "--speedup-ratio", "0", "--max-model-len", "64") as api,
        openai.OpenAI(base_url=api.base_url, api_key="none", max_retries=0) as client,
    ):
        yield client


@pytest.mark.parametrize(
    ("extra", "kept"),
    [
        ({"truncate_prompt_tokens": 4}, PROMPT[:4]),  # the tokenizer's side: right
        ({"truncate_prompt_tokens": 4, "truncation_side": "left"}, PROMPT[-4:]),
        ({"truncate_prompt_tokens": 40}, PROMPT),
    ],
)
def test_the_prompt_is_cut_to_n_tokens(
    client: openai.OpenAI, extra: dict[str, object], kept: list[int]
) -> None:
    reply = client.completions.create(
        model="engined", prompt=PROMPT, max_tokens=1, echo=True, extra_body=extra
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(kept)
    text = load_tokenizer(None, None).decode(kept)
    assert reply.choices[0].text.startswith(text)


def test_minus_one_keeps_the_context_less_one_token(client: openai.OpenAI) -> None:
    prompt = list(range(100, 200))
    reply = client.completions.create(
        model="engined",
        prompt=prompt,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1, "truncation_side": "left"},
    )
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (63, 1)
