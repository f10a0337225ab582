"""vLLM's response-shaping flags in a real `engined serve`, through the official `openai`
client. `--enable-force-include-usage`: every streamed response ends with a usage chunk and
carries usage on every chunk, as `stream_options` with `include_usage` and
`continuous_usage_stats` would, whatever the request's own `stream_options` say (vLLM's
`should_include_usage`). `--return-tokens-as-token-ids`: logprobs name tokens
`token_id:{id}`, unless a request's `return_tokens_as_token_ids` says otherwise, and a
request may ask for it without the flag. `--response-role`: the role of a chat's answer
when the request adds the generation prompt (else the last message's, as vLLM's)."""

from __future__ import annotations

from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.openai.api_harness import start_api


def test_streams_carry_usage_whatever_they_ask(tmp_path: Path) -> None:
    with (
        start_api(tmp_path, "--speedup-ratio", "0", "--enable-force-include-usage") as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        for options in (None, {"include_usage": False}):
            extra = {} if options is None else {"stream_options": options}
            *deltas, last = client.completions.create(
                model="engined", prompt=[1, 2, 3, 4], max_tokens=5, stream=True, extra_body=extra
            )
            assert last.choices == [] and last.usage is not None
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 5)
            counts = [c.usage.completion_tokens for c in deltas if c.usage is not None]
            assert len(counts) == len(deltas) and counts[-1] == 5, counts
        *chunks, tail = client.chat.completions.create(
            model="engined",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
        assert tail.choices == [] and tail.usage is not None
        assert tail.usage.completion_tokens == 4
        assert all(c.usage is not None for c in chunks)
        assert chunks[0].usage is not None and chunks[0].usage.completion_tokens == 0


def named(client: openai.OpenAI, ask: bool | None) -> str:
    """How a completion's and a chat's logprobs name their tokens: "ids" or "text" (both
    the same way)."""
    extra: dict[str, object] = {"return_token_ids": True}
    if ask is not None:
        extra["return_tokens_as_token_ids"] = ask
    done = client.completions.create(
        model="engined", prompt=[1, 2], max_tokens=3, logprobs=1, extra_body=extra
    )
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    ids = [f"token_id:{i}" for i in (choice.model_extra or {})["token_ids"]]
    chat = client.chat.completions.create(
        model="engined",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        extra_body=extra,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    chat_ids = [f"token_id:{i}" for i in (chat.choices[0].model_extra or {})["token_ids"]]
    names = [t.token for t in content.content]
    if choice.logprobs.tokens == ids and names == chat_ids:
        return "ids"
    assert not any(t.startswith("token_id:") for t in [*choice.logprobs.tokens, *names])
    return "text"


def test_logprob_tokens_by_id_and_the_response_role_with_the_flags(tmp_path: Path) -> None:
    flags = ("--speedup-ratio", "0", "--return-tokens-as-token-ids", "--response-role", "bot")
    with (
        start_api(tmp_path, *flags) as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        assert named(client, None) == "ids"
        assert named(client, False) == "text"
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        done = client.chat.completions.create(model="engined", messages=messages, max_tokens=2)
        # The openai package types the role as "assistant"; read it as sent.
        assert done.choices[0].message.model_dump()["role"] == "bot"
        first = next(
            iter(
                client.chat.completions.create(
                    model="engined", messages=messages, max_tokens=2, stream=True
                )
            )
        )
        assert first.choices[0].delta.model_dump()["role"] == "bot"
        # Without the generation prompt the answer continues the last message's role.
        cont = client.chat.completions.create(
            model="engined",
            messages=messages,
            max_tokens=2,
            extra_body={"add_generation_prompt": False},
        )
        assert cont.choices[0].message.model_dump()["role"] == "user"


def test_without_the_flags_a_request_asks(tmp_path: Path) -> None:
    with (
        start_api(tmp_path, "--speedup-ratio", "0") as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        chunks = list(
            client.completions.create(model="engined", prompt=[1, 2], max_tokens=3, stream=True)
        )
        assert all(c.usage is None for c in chunks)
        assert named(client, None) == "text"
        assert named(client, True) == "ids"
