"""The official `openai` client against a real `engined serve` (issue 22, Acceptance 1).

One daemon for the module (unpaced, block 16, `--enable-prompt-tokens-details`, an API key,
two API server processes), so every request also crosses whichever API process the kernel
hands its connection to. Prompts are token-id lists where counts must be exact (vLLM counts
them as given) and distinct per test, so no test meets another's cached blocks unless it
means to. About 10 s.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.openai.api_harness import ApiDaemon, start_api

KEY = "test-key"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    flags = ("--speedup-ratio", "0", "--block-size", "16", "--enable-prompt-tokens-details")
    tmp = tmp_path_factory.mktemp("client")
    with start_api(tmp, *flags, "--api-key", KEY, servers=2) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(api: ApiDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=api.base_url, api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def call(port: int, method: str, path: str, body: object = None) -> tuple[int, object]:
    """(status, decoded JSON or None) of one plain HTTP request, as a client with no key."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        connection.request(method, path, payload, headers)
        answer = connection.getresponse()
        data = answer.read()
        return answer.status, json.loads(data) if data else None
    finally:
        connection.close()


def ids(first: int, count: int) -> list[int]:
    """A token-id prompt of `count` ids no other test uses (each test picks its own `first`)."""
    return list(range(first, first + count))


def token_ids(client: openai.OpenAI, model: str, prompt: list[int], **kw: object) -> list[int]:
    """The generated ids of one seeded completion (vLLM's `return_token_ids`)."""
    done = client.completions.create(
        model=model, prompt=prompt, extra_body={"return_token_ids": True, **kw}
    )
    out = done.choices[0].model_extra or {}
    return list(out["token_ids"])


def test_completion_counts_are_exact(client: openai.OpenAI, model: str) -> None:
    done = client.completions.create(model=model, prompt=ids(1000, 7), max_tokens=MAX_TOKENS)
    assert done.object == "text_completion"
    assert done.id.startswith("cmpl-")
    assert done.model == model
    assert [c.index for c in done.choices] == [0]
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, MAX_TOKENS)
    assert done.usage.total_tokens == 7 + MAX_TOKENS


def test_chat_counts_are_exact(api: ApiDaemon, client: openai.OpenAI, model: str) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "count the chat prompt's tokens exactly"}
    ]
    status, tokenized = call(
        api.port,
        "POST",
        "/tokenize",
        {"model": model, "messages": messages, "add_generation_prompt": True},
    )
    assert status == 200 and isinstance(tokenized, dict)
    done = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=MAX_TOKENS,
    )
    assert done.object == "chat.completion"
    assert done.id.startswith("chatcmpl-")
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])
    assert done.usage.completion_tokens == MAX_TOKENS


def test_completion_stream_with_usage(client: openai.OpenAI, model: str) -> None:
    prompt = ids(2000, 9)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=20, seed=5)
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=20,
        seed=5,
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = list(stream)
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (9, 20)
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    counts = [c.usage.completion_tokens for c in deltas if c.usage is not None]
    assert len(counts) == len(deltas) and counts == sorted(counts) and counts[-1] == 20
    assert all(c.usage is not None and c.usage.prompt_tokens == 9 for c in deltas)
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_with_usage(client: openai.OpenAI, model: str) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "stream a chat with usage please"}
    ]
    whole = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=15,
        seed=6,
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=15,
            seed=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == (
        whole.choices[0].message.content
    )
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in deltas)
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == 15


def test_n_with_seed(client: openai.OpenAI, model: str) -> None:
    prompt = ids(3000, 5)
    many = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=3, seed=40)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage is not None
    assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (5, 24)
    singles = [
        client.completions.create(model=model, prompt=prompt, max_tokens=8, seed=40 + j)
        for j in range(3)
    ]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) == 3
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=3, seed=40)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "n chat samples"}],
        max_tokens=6,
        n=2,
        seed=9,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens == 12


def test_echo(client: openai.OpenAI, model: str) -> None:
    prompt = "echo me back, then go on"
    done = client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, seed=3)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=4, seed=3)
    assert done.choices[0].text == prompt + plain.choices[0].text


def test_logprobs_are_well_formed(client: openai.OpenAI, model: str) -> None:
    done = client.completions.create(model=model, prompt=ids(4000, 6), max_tokens=7, logprobs=3)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 7
    assert all(lp is not None and lp <= 0.0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert all(
        token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "chat logprobs"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    assert len(content.content) == 5
    assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in content.content)


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    prompt = ids(500, 4)
    free = client.completions.create(model=model, prompt=prompt, max_tokens=16, seed=11)
    text = free.choices[0].text
    word = text.split()[2]
    cut = text.index(word)
    stopped = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, seed=11, stop=[word]
    )
    choice = stopped.choices[0]
    assert choice.text == text[:cut]
    assert choice.finish_reason == "stop"
    assert (choice.model_extra or {})["stop_reason"] == word
    assert stopped.usage is not None and stopped.usage.completion_tokens < 16


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = ids(600, 4)
    free = token_ids(client, model, prompt, max_tokens=16, seed=12)
    at = 3
    stop = free[at]
    assert stop not in free[:at]
    done = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        seed=12,
        extra_body={"stop_token_ids": [stop], "return_token_ids": True},
    )
    choice = done.choices[0]
    assert (choice.model_extra or {})["token_ids"] == free[: at + 1]
    assert choice.finish_reason == "stop"
    assert (choice.model_extra or {})["stop_reason"] == stop
    assert done.usage is not None and done.usage.completion_tokens == at + 1
    # vLLM's detokenizer leaves a stop token's own text out.
    head = client.completions.create(model=model, prompt=prompt, max_tokens=at, seed=12)
    assert choice.text == head.choices[0].text
    kept = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        seed=12,
        extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True},
    )
    upto = client.completions.create(model=model, prompt=prompt, max_tokens=at + 1, seed=12)
    assert kept.choices[0].text == upto.choices[0].text
    # min_tokens: the stop id cannot end the request before its min_tokens-th token.
    late = token_ids(
        client,
        model,
        prompt,
        max_tokens=16,
        seed=12,
        stop_token_ids=[free[0]],
        min_tokens=6,
        ignore_eos=True,
    )
    assert len(late) >= 6 and free[0] not in late[:5]
    assert free[0] not in late[:-1]
    assert late[-1] == free[0] or len(late) == 16


def test_ignore_eos_gives_max_tokens(client: openai.OpenAI, model: str) -> None:
    done = client.completions.create(
        model=model, prompt=ids(700, 3), max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 40
    assert done.choices[0].finish_reason == "length"


def test_cached_tokens_and_cache_salt(client: openai.OpenAI, model: str) -> None:
    prompt = ids(800, 40)

    def cached(**extra: object) -> int | None:
        done = client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body=extra)
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 32
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") == 32
    assert cached() == 32


def test_request_id_header(client: openai.OpenAI, model: str) -> None:
    done = client.completions.create(
        model=model,
        prompt=ids(900, 3),
        max_tokens=2,
        extra_headers={"X-Request-Id": "my-trace-17"},
    )
    assert done.id == "cmpl-my-trace-17"
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "request id"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "my-trace-18"},
    )
    assert chat.id == "chatcmpl-my-trace-18"


def test_small_routes(api: ApiDaemon, client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].owned_by == "vllm"
    status, tokenized = call(api.port, "POST", "/tokenize", {"prompt": "hello tokenizer"})
    assert status == 200 and isinstance(tokenized, dict)
    assert tokenized["count"] == len(tokenized["tokens"])
    text = call(api.port, "POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert text == (200, {"prompt": "hello tokenizer"})
    assert call(api.port, "GET", "/version") == (200, {"version": "0.33.0"})
    assert call(api.port, "GET", "/health") == (200, None)
    status, sources = call(api.port, "GET", "/kv_event_sources")
    assert status == 200 and isinstance(sources, dict) and list(sources) == ["0"]
    assert sources["0"]["endpoint"] == api.daemon.kv_endpoint(0)


def test_kv_event_sources_of_a_daemon_without_kv_events_is_empty(tmp_path: Path) -> None:
    """vLLM with `enable_kv_cache_events: false` lists no publisher; neither does engined."""
    off = ("--kv-events-endpoint", "", "--kv-replay-endpoint", "", "--speedup-ratio", "0")
    with start_api(tmp_path, *off) as api:
        assert call(api.port, "GET", "/kv_event_sources") == (200, {})
        status, completion = call(
            api.port,
            "POST",
            "/v1/completions",
            {"model": "engined", "prompt": ids(700, 8), "max_tokens": 3},
        )
    assert status == 200 and isinstance(completion, dict), completion
    assert completion["usage"]["completion_tokens"] == 3


def test_api_key(api: ApiDaemon, model: str) -> None:
    bad = openai.OpenAI(base_url=api.base_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as refused:
        bad.models.list()
    assert refused.value.status_code == 401
    assert call(api.port, "GET", "/v1/models") == (401, {"error": "Unauthorized"})
    assert call(api.port, "GET", "/health") == (200, None)


def test_two_api_servers_serve_many_concurrent_requests(api: ApiDaemon, model: str) -> None:
    async def many() -> list[int]:
        async with openai.AsyncOpenAI(base_url=api.base_url, api_key=KEY, max_retries=0) as c:
            done = await asyncio.gather(
                *(
                    c.completions.create(model=model, prompt=ids(1100 + 8 * i, 8), max_tokens=6)
                    for i in range(64)
                )
            )
        return [d.usage.completion_tokens if d.usage else -1 for d in done]

    assert asyncio.run(many()) == [6] * 64


def test_errors_have_vllm_messages(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert unknown.value.body == {
        "message": f"The model `no-such-model` does not exist. Valid aliases: {model}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=40_000)
    assert too_long.value.body == {
        "message": "max_tokens=40000 cannot be greater than max_model_len=32768. Please request "
        "fewer output tokens. (parameter=max_tokens, value=40000)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    with pytest.raises(openai.BadRequestError) as invalid:
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=3)
    assert invalid.value.body == {
        "message": "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }
    with pytest.raises(openai.BadRequestError) as template:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"chat_template": "{{ messages }}"},
        )
    assert template.value.body == {
        "message": "Chat template is passed with request, but --trust-request-chat-template is "
        "not set. Refused request with untrusted chat template.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


def test_context_length(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as over:
        client.completions.create(model=model, prompt=[5] * 32_800, max_tokens=1)
    assert over.value.body == {
        "message": "This model's maximum context length is 32768 tokens. However, your prompt "
        "contains 32800 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=32800)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
