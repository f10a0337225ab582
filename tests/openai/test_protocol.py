"""Request forms decoded to what they say, and responses encoded byte for byte as vLLM 0.33's.

`vllm_0_33_shapes.json` holds vLLM's own serialization of its response models (its "about"
says how they were recorded); each is rebuilt here from this engine's structs and builders.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engined.openai.api_errors import (
    ApiError,
    engine_overloaded,
    generation_error,
    model_not_found,
    validation_error,
)
from engined.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    decode_chat_request,
    decode_completion_request,
    decode_detokenize_request,
    decode_tokenize_request,
)
from engined.openai.protocol_responses import (
    ENCODE,
    SSE_DONE,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    chat_echo_chunk,
    chat_finish_choice,
    chat_role_chunk,
    chat_usage_chunk,
    completion_usage_chunk,
    continuous_usage,
    final_stream_usage,
    model_card,
    sse,
    usage,
)

SHAPES: dict[str, str] = json.loads((Path(__file__).parent / "vllm_0_33_shapes.json").read_text())[
    "shapes"
]


def test_prompt_forms() -> None:
    forms: list[Any] = ["Hello", ["Hello", "World"], [1, 2, 3], [[1, 2], [3]], [], [[]]]
    for prompt in forms:
        request = decode_completion_request(json.dumps({"prompt": prompt}).encode())
        assert request.prompt == prompt
    mixed = decode_completion_request(b'{"prompt": [true, 2.0, "3"], "max_tokens": "7"}')
    assert (mixed.prompt, mixed.max_tokens) == ([1, 2, 3], 7)
    strings = decode_completion_request(b'{"prompt": ["1", "2"]}')
    assert strings.prompt == ["1", "2"]


def test_completion_defaults_are_vllms() -> None:
    request = decode_completion_request(b'{"prompt": "x", "max_tokens": null, "foo": [1]}')
    assert request.max_tokens == 16
    assert (request.n, request.echo, request.stream, request.stop) == (1, False, False, [])
    assert (request.stop_token_ids, request.min_tokens, request.priority) == ([], 0, 0)
    assert (request.temperature, request.logprobs, request.stream_options) == (None, None, None)
    assert (request.add_special_tokens, request.mm_payload) == (True, "tensors")
    assert len(request.request_id) == 32
    assert request.request_id != decode_completion_request(b'{"prompt": "x"}').request_id


def test_message_forms() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]},
            {"role": "assistant", "content": None, "reasoning_content": "hmm"},
            {"role": "reviewer", "content": "custom roles pass"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "top_logprobs": None,
    }
    request = decode_chat_request(json.dumps(body).encode())
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "reviewer"]
    assert request.messages[1].content == [{"type": "text", "text": "Hi"}, "there"]
    assert (request.messages[2].content, request.messages[2].reasoning) == (None, "hmm")
    assert request.stream_options is not None and request.stream_options.continuous_usage_stats
    assert (request.top_logprobs, request.tool_choice, request.max_tokens) == (0, "none", None)
    tools = {"messages": body["messages"], "tools": [{"function": {"name": "f"}}]}
    assert decode_chat_request(json.dumps(tools).encode()).tool_choice == "auto"


def test_tokenize_forms() -> None:
    prompt = decode_tokenize_request(b'{"prompt": "hi", "return_token_strs": true}')
    assert isinstance(prompt, TokenizeCompletionRequest)
    assert (prompt.prompt, prompt.add_special_tokens, prompt.return_token_strs) == (
        "hi",
        True,
        True,
    )
    chat = decode_tokenize_request(b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert isinstance(chat, TokenizeChatRequest)
    assert (chat.add_generation_prompt, chat.add_special_tokens) == (True, False)
    assert decode_detokenize_request(b'{"tokens": [0, 5, 9]}').tokens == [0, 5, 9]


@pytest.mark.parametrize(
    ("decode", "body"),
    [
        (decode_completion_request, {"prompt": [[1, 2], [3]], "logprobs": 3, "echo": True}),
        (decode_completion_request, {"prompt": "x", "response_format": {"type": "json_object"}}),
        (decode_chat_request, {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ],
)
def test_a_decoded_request_survives_its_own_encoding(
    decode: Callable[[bytes], CompletionRequest | ChatCompletionRequest], body: dict[str, Any]
) -> None:
    request = decode(json.dumps(body).encode())
    assert decode(msgspec.json.encode(request)) == request


def test_a_million_token_ids_decode() -> None:
    ids = list(range(1_000_000))
    request = decode_completion_request(json.dumps({"prompt": ids}).encode())
    assert request.prompt == ids
    detokenize = decode_detokenize_request(json.dumps({"tokens": ids}).encode())
    assert detokenize.tokens == ids


def test_a_million_token_ids_with_one_bad_are_counted_like_pydantic() -> None:
    ids: list[int] = [*range(999_999), -1]
    with pytest.raises(ApiError) as info:
        decode_completion_request(json.dumps({"prompt": ids}).encode())
    lines = info.value.message.splitlines()
    assert lines[0] == "2000002 validation errors:"
    assert lines[1] == (
        "  {'type': 'greater_than_equal', 'loc': 'body.prompt.999999', 'msg': 'Input should be "
        "greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}"
    )
    assert lines[-1] == "  ...and 1999992 more errors"
    assert info.value.param == "body.prompt.999999"


def test_a_deep_body_is_unreadable_and_a_long_value_is_cut() -> None:
    deep = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError) as info:
        decode_completion_request(deep)
    assert info.value.body() == b'{"detail":"There was an error parsing the body"}'
    with pytest.raises(ApiError) as info:
        decode_completion_request(json.dumps({"prompt": "a", "n": "9" * 10_000 + "x"}).encode())
    assert info.value.message.endswith("'input': '" + "9" * 200 + "...[truncated]'}")


def _completion_logprobs() -> CompletionLogProbs:
    return CompletionLogProbs(
        text_offset=[0, 3],
        token_logprobs=[-0.5, -1.25],
        tokens=["foo", " bar"],
        top_logprobs=[{"foo": -0.5, "x": -2.0}, {" bar": -1.25, "y": -0.75}],
    )


def _chat_logprobs() -> ChatCompletionLogProbs:
    top = [
        ChatCompletionLogProb(token="Hi", logprob=-0.25, bytes=[72, 105]),
        ChatCompletionLogProb(token="Yo", logprob=-1.5, bytes=[89, 111]),
    ]
    content = ChatCompletionLogProbsContent(
        token="Hi", logprob=-0.25, bytes=[72, 105], top_logprobs=top
    )
    return ChatCompletionLogProbs(content=[content])


def _completion(text: str, finish: str, logprobs: CompletionLogProbs | None, **kw: Any) -> Any:
    choice = CompletionResponseChoice(index=0, text=text, logprobs=logprobs, finish_reason=finish)
    return CompletionResponse(id="cmpl-1", created=100, model="m", choices=[choice], **kw)


def _completion_chunk(text: str, finish: str | None = None, **kw: Any) -> Any:
    logprobs = kw.pop("logprobs", None)
    choice = CompletionResponseStreamChoice(
        index=0, text=text, logprobs=logprobs, finish_reason=finish
    )
    return CompletionStreamResponse(id="cmpl-1", created=100, model="m", choices=[choice], **kw)


def _chat(logprobs: ChatCompletionLogProbs | None, finish: str, details: int | None) -> Any:
    choice = ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="Hi"), logprobs=logprobs
    )
    choice.finish_reason = finish
    return ChatCompletionResponse(
        id="chatcmpl-1",
        created=100,
        model="m",
        choices=[choice],
        usage=usage(5, 1, cached_tokens=details),
        system_fingerprint="fp",
    )


def _chat_chunk(choice: ChatCompletionResponseStreamChoice, **kw: Any) -> Any:
    return ChatCompletionStreamResponse(
        id="chatcmpl-1", created=100, model="m", choices=[choice], **kw
    )


def _delta(logprobs: ChatCompletionLogProbs | None = None) -> ChatCompletionResponseStreamChoice:
    return ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(content="Hi"), logprobs=logprobs
    )


def _error() -> ApiError:
    return validation_error("bad \u201cx\u201d", param="logprobs", value=21)


BUILDERS: dict[str, Callable[[], Any]] = {
    "completion": lambda: _completion(
        "foo bar",
        "length",
        _completion_logprobs(),
        usage=usage(5, 2, cached_tokens=4),
        system_fingerprint="fp",
    ),
    "completion_plain_usage": lambda: _completion("x", "stop", None, usage=usage(1, 1)),
    "completion_chunk": lambda: _completion_chunk("foo"),
    "completion_chunk_lp": lambda: _completion_chunk(
        "foo",
        logprobs=CompletionLogProbs(
            text_offset=[0], token_logprobs=[-0.5], tokens=["foo"], top_logprobs=[{"foo": -0.5}]
        ),
    ),
    "completion_chunk_final_fp": lambda: _completion_chunk("", "length", system_fingerprint="fp"),
    "completion_chunk_cont": lambda: _completion_chunk(
        "foo", usage=continuous_usage(5, 1, chat=False)
    ),
    "completion_usage_chunk": lambda: completion_usage_chunk(
        "cmpl-1", 100, "m", final_stream_usage(5, 2, cached_tokens=0), "fp"
    ),
    "completion_usage_chunk_nodetails": lambda: completion_usage_chunk(
        "cmpl-1", 100, "m", final_stream_usage(5, 2), None
    ),
    "chat": lambda: _chat(_chat_logprobs(), "length", 4),
    "chat_no_details": lambda: _chat(None, "stop", None),
    "chat_first_chunk": lambda: chat_role_chunk("chatcmpl-1", 100, "m", 0, "assistant"),
    "chat_first_chunk_cont": lambda: chat_role_chunk(
        "chatcmpl-1", 100, "m", 0, "assistant", usage=continuous_usage(5, 0, chat=True)
    ),
    "chat_echo_chunk": lambda: chat_echo_chunk("chatcmpl-1", 100, "m", 0, "prev"),
    "chat_delta_chunk": lambda: _chat_chunk(_delta()),
    "chat_delta_chunk_lp": lambda: _chat_chunk(_delta(_chat_logprobs())),
    "chat_delta_chunk_cont": lambda: _chat_chunk(_delta(), usage=continuous_usage(5, 1, chat=True)),
    "chat_final_chunk": lambda: _chat_chunk(
        chat_finish_choice(0, DeltaMessage(content=""), "stop"), system_fingerprint="fp"
    ),
    "chat_final_chunk_empty_delta": lambda: _chat_chunk(
        chat_finish_choice(0, DeltaMessage(), "length")
    ),
    "chat_usage_chunk": lambda: chat_usage_chunk(
        "chatcmpl-1", 100, "m", final_stream_usage(5, 2, cached_tokens=4), "fp"
    ),
    "chat_usage_chunk_nodetails": lambda: chat_usage_chunk(
        "chatcmpl-1", 100, "m", final_stream_usage(5, 2), None
    ),
    "models": lambda: ModelList(data=[model_card("m", "/models/m", 4096, 100)]),
    "tokenize": lambda: TokenizeResponse(count=2, max_model_len=4096, tokens=[1, 2]),
    "tokenize_strs": lambda: TokenizeResponse(
        count=2, max_model_len=4096, tokens=[1, 2], token_strs=["a", "\u00e9"]
    ),
    "detokenize": lambda: DetokenizeResponse(prompt="h\u00e9llo"),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_response_bytes_are_vllms(name: str) -> None:
    built = ENCODE(BUILDERS[name]())
    if name == "models":
        built = built.replace(b'"id":"modelperm-', b'"id":"modelperm-@', 1)
        prefix, _, rest = built.partition(b"@")
        # vLLM's random_uuid(): 16 hex digits, recorded as "1".
        built = prefix + b"1" + rest[16:]
    assert built == SHAPES[name].encode()


def test_every_recorded_shape_is_built() -> None:
    errors = {"error", "error_stream_completion", "error_stream_chat", "overloaded", "notfound"}
    errors |= {"generation_error", "chat_stream_gen_error"}
    assert set(SHAPES) == set(BUILDERS) | errors


def test_error_bodies_and_stream_events_are_vllms() -> None:
    assert _error().body() == SHAPES["error"].encode()
    assert _error().stream_event(chat=False) == sse(SHAPES["error_stream_completion"].encode())
    assert _error().stream_event(chat=True) == sse(SHAPES["error_stream_chat"].encode())
    assert engine_overloaded().body() == SHAPES["overloaded"].encode()
    assert model_not_found("x", ["m"]).body() == SHAPES["notfound"].encode()
    assert generation_error().body() == SHAPES["generation_error"].encode()
    assert generation_error().stream_event(chat=True) == sse(
        SHAPES["chat_stream_gen_error"].encode()
    )
    assert (engine_overloaded().status, model_not_found("x", ["m"]).status) == (503, 404)


def test_sse_framing() -> None:
    assert sse(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
