"""Requests refused (and accepted) exactly as vLLM 0.33 does: status and body, byte for byte.

`vllm_0_33_answers.json` holds vLLM's own answers to ~200 bodies (its "about" says how they
were recorded). Each is replayed through decoding and the serving-layer checks in vLLM's
order, with the recording's settings; an accepted body must give the same `max_tokens`. The
few bodies this engine answers differently on purpose are tested below with what it answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engined.openai.api_errors import ApiError, context_length_error
from engined.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_request,
    decode_completion_request,
    decode_detokenize_request,
    decode_tokenize_request,
)
from engined.openai.protocol_sampling import (
    check_engine,
    check_sampling,
    effective_max_tokens,
    requested_max_tokens,
)

ANSWERS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "vllm_0_33_answers.json").read_text()
)["cases"]
MAX_MODEL_LEN = 100
VOCAB_SIZE = 1000
CHAT_PROMPT_TOKENS = 5


def _body(case: dict[str, Any]) -> bytes:
    if "raw_hex" in case:
        return bytes.fromhex(case["raw_hex"])
    if "raw" in case:
        return str(case["raw"]).encode()
    return json.dumps(case["body"]).encode()


def _prompt_tokens(request: CompletionRequest) -> int:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    return 3


def _serve(request: CompletionRequest | ChatCompletionRequest, prompt_tokens: int) -> bytes:
    """The recording's route: context checks, sampling checks, then the engine's logprobs."""
    requested, param = requested_max_tokens(request)
    error = context_length_error(
        MAX_MODEL_LEN,
        prompt_tokens,
        requested,
        max_tokens_param=param,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
    )
    if error is not None:
        raise error
    max_tokens = effective_max_tokens(MAX_MODEL_LEN, prompt_tokens, request)
    check_sampling(request, max_tokens)
    check_engine(
        request,
        list(range(prompt_tokens)),
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
    )
    return b'{"ok":true,"max_tokens":%d}' % max_tokens


def _answer(case: dict[str, Any]) -> tuple[int, bytes]:
    body = _body(case)
    content_type = case.get("content_type", "application/json") or None
    try:
        if case["endpoint"] == "completion":
            completion = decode_completion_request(body, content_type)
            return 200, _serve(completion, _prompt_tokens(completion))
        if case["endpoint"] == "chat":
            return 200, _serve(decode_chat_request(body, content_type), CHAT_PROMPT_TOKENS)
        if case["endpoint"] == "tokenize":
            kind = type(decode_tokenize_request(body, content_type)).__name__
            return 200, b'{"ok":true,"kind":"%s"}' % kind.encode()
        decode_detokenize_request(body, content_type)
        return 200, b'{"ok":true}'
    except ApiError as error:
        return error.status, error.body()


@pytest.mark.parametrize("case", ANSWERS, ids=[case["name"] for case in ANSWERS])
def test_answers_as_vllm(case: dict[str, Any]) -> None:
    assert _answer(case) == (case["status"], case["response"].encode())


def test_the_recording_covers_every_kind_of_answer() -> None:
    statuses = {case["status"] for case in ANSWERS}
    kinds = {json.loads(case["response"]).get("error", {}).get("type") for case in ANSWERS}
    assert statuses == {200, 400}
    assert kinds == {None, "Bad Request", "BadRequestError"}
    assert sum(1 for case in ANSWERS if case["status"] == 200) >= 40


def _refusal(decode: Any, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(body)
    return info.value


def test_a_message_missing_its_role_is_named_at_the_field() -> None:
    """vLLM lists one error per member of its 8-way message union (11 here); this engine
    names the field once."""
    error = _refusal(decode_chat_request, b'{"messages": [{"content": "hi"}]}')
    assert (error.status, error.type, error.param) == (400, "Bad Request", "body.messages.0.role")
    assert error.message == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages.0.role', "
        "'msg': 'Field required', 'input': '<dict of 1 items>'}"
    )


def test_a_message_of_a_wrong_role_or_content_type_is_named_at_the_field() -> None:
    error = _refusal(decode_chat_request, b'{"messages": [{"role": 5, "content": "hi"}]}')
    assert error.message == (
        "1 validation error:\n  {'type': 'string_type', 'loc': 'body.messages.0.role', "
        "'msg': 'Input should be a valid string', 'input': '5'}"
    )
    error = _refusal(decode_chat_request, b'{"messages": [{"role": "user", "content": 5}]}')
    assert error.param == "body.messages.0.content"
    assert error.message.startswith("2 validation errors:\n  {'type': 'string_type'")


def test_a_null_content_is_only_an_assistants_or_a_named_functions() -> None:
    for message in (
        {"role": "assistant", "content": None},
        {"role": "function", "name": "f", "content": None},
        {"role": "user"},
    ):
        body = json.dumps({"messages": [message]}).encode()
        assert decode_chat_request(body).messages[0].content is None
    error = _refusal(decode_chat_request, b'{"messages": [{"role": "user", "content": null}]}')
    assert (error.param, error.message) == (
        "body.messages.0.content",
        "1 validation error:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', "
        "'msg': 'Input should be a valid string', 'input': 'None'}",
    )


def test_a_lone_surrogate_is_an_unreadable_body() -> None:
    """vLLM accepts `"\\ud800"` and fails later, writing it as UTF-8; this engine refuses it."""
    error = _refusal(decode_completion_request, b'{"prompt": "a\\ud800"}')
    assert error.status == 400
    assert error.body() == b'{"detail":"There was an error parsing the body"}'
    assert decode_completion_request(b'{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"
