"""vLLM 0.33's OpenAI response bodies and stream chunks, byte for byte.

vLLM writes a whole response with `JSONResponse(model.model_dump())`: every field, nulls
included, in declaration order. Its stream chunks are `model_dump_json(exclude_unset=True)`:
only the fields its serving code set, nulls included when it set them to None; the closing
usage chunk also drops every null. Here a field vLLM may leave out is `UNSET` by default
(msgspec omits it) and None where vLLM always writes it, so a struct built with its defaults
encodes as vLLM's common case, and the builders below give the other shapes. `ENCODE` is one
reused encoder; `sse(data)` frames an event and `SSE_DONE` ends a stream. The bodies of the
endpoints that generate nothing are in `engined.openai.protocol_info_responses`, re-exported
here.

Usage: vLLM reports `prompt_tokens_details` only under `--enable-prompt-tokens-details`; chat
then also reports `created_cache_tokens`, the prompt tokens the request itself wrote to the
prefix cache (its full blocks after prefill, up to the prompt's length, less the cached ones);
completions leave it null.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, UnsetType

from engined.openai.protocol_info_responses import (
    DetokenizeResponse as DetokenizeResponse,
)
from engined.openai.protocol_info_responses import (
    ModelCard as ModelCard,
)
from engined.openai.protocol_info_responses import (
    ModelList as ModelList,
)
from engined.openai.protocol_info_responses import (
    ModelPermission as ModelPermission,
)
from engined.openai.protocol_info_responses import (
    TokenizeResponse as TokenizeResponse,
)
from engined.openai.protocol_info_responses import (
    VersionResponse as VersionResponse,
)
from engined.openai.protocol_info_responses import (
    model_card as model_card,
)

ENCODE: Final = msgspec.json.Encoder().encode
SSE_DONE: Final = b"data: [DONE]\n\n"


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class PromptTokenUsageInfo(msgspec.Struct, kw_only=True):
    cached_tokens: int | None = None
    created_cache_tokens: int | UnsetType | None = None
    multimodal_tokens: dict[str, int] | UnsetType | None = None


class CompletionTokenUsageInfo(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | UnsetType | None = None
    completion_tokens_details: CompletionTokenUsageInfo | UnsetType | None = None


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    created_cache_tokens: int | None = None,
) -> UsageInfo:
    """A whole response's usage; details only when `cached_tokens` is given."""
    details = None
    if cached_tokens is not None:
        details = PromptTokenUsageInfo(
            cached_tokens=cached_tokens, created_cache_tokens=created_cache_tokens
        )
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens=completion_tokens,
        prompt_tokens_details=details,
    )


def final_stream_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    created_cache_tokens: int | None = None,
) -> UsageInfo:
    """The closing usage chunk's usage (`stream_options.include_usage`), nulls dropped."""
    details: PromptTokenUsageInfo | UnsetType = UNSET
    if cached_tokens is not None:
        created: int | UnsetType = UNSET if created_cache_tokens is None else created_cache_tokens
        details = PromptTokenUsageInfo(
            cached_tokens=cached_tokens, created_cache_tokens=created, multimodal_tokens=UNSET
        )
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens=completion_tokens,
        prompt_tokens_details=details,
        completion_tokens_details=UNSET,
    )


def continuous_usage(prompt_tokens: int, completion_tokens: int, *, chat: bool) -> UsageInfo:
    """The usage each chunk carries under `continuous_usage_stats` (chat adds a null)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens=completion_tokens,
        prompt_tokens_details=UNSET,
        completion_tokens_details=None if chat else UNSET,
    )


class CompletionLogProbs(msgspec.Struct, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    weight_versions: list[Any] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class CompletionResponseStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    weight_versions: list[Any] | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    """A completion stream chunk; `system_fingerprint` only on the last one without usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    metrics: dict[str, Any] | UnsetType = UNSET
    kv_transfer_params: dict[str, Any] | UnsetType | None = None


def completion_usage_chunk(
    request_id: str, created: int, model: str, usage: UsageInfo, system_fingerprint: str | None
) -> CompletionStreamResponse:
    """The closing chunk of `include_usage`: no choices, `final_stream_usage`."""
    return CompletionStreamResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[],
        usage=usage,
        system_fingerprint=UNSET if system_fingerprint is None else system_fingerprint,
        kv_transfer_params=UNSET,
    )


class ChatCompletionLogProb(msgspec.Struct, kw_only=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(msgspec.Struct, kw_only=True):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(msgspec.Struct, kw_only=True):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """The assistant's message; vLLM drops `tool_calls` when there are none."""

    role: str
    content: str | None = None
    refusal: str | None = None
    annotations: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    reasoning: str | None = None


class ChatCompletionResponseChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    weight_versions: list[Any] | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class DeltaMessage(msgspec.Struct, kw_only=True):
    """A chunk's delta: only what changed (`{}` on a closing chunk that adds no text)."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class ChatCompletionResponseStreamChoice(msgspec.Struct, kw_only=True):
    """A chat chunk's choice. The role chunk leaves out `token_ids`; the closing one adds
    `stop_reason` and `weight_versions` (`chat_finish_choice`)."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | UnsetType | None = UNSET
    token_ids: list[int] | UnsetType | None = None
    weight_versions: list[Any] | UnsetType | None = UNSET


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType | None = UNSET
    prompt_text: str | UnsetType | None = UNSET
    metrics: dict[str, Any] | UnsetType = UNSET
    kv_transfer_params: dict[str, Any] | UnsetType | None = None


def chat_role_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    role: str,
    *,
    prompt_token_ids: list[int] | None = None,
    prompt_text: str | None = None,
    usage: UsageInfo | UnsetType = UNSET,
) -> ChatCompletionStreamResponse:
    """The first chunk of each choice: its role and empty content."""
    choice = ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(role=role, content=""), token_ids=UNSET
    )
    return ChatCompletionStreamResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[choice],
        usage=usage,
        prompt_token_ids=prompt_token_ids,
        prompt_text=prompt_text,
        kv_transfer_params=UNSET,
    )


def chat_echo_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    content: str,
    *,
    usage: UsageInfo | UnsetType = UNSET,
) -> ChatCompletionStreamResponse:
    """`echo`: after the role chunks, the last message's content when its role is the reply's."""
    choice = ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(content=content), token_ids=UNSET
    )
    return ChatCompletionStreamResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[choice],
        usage=usage,
        kv_transfer_params=UNSET,
    )


def chat_finish_choice(
    index: int,
    delta: DeltaMessage,
    finish_reason: str,
    *,
    logprobs: ChatCompletionLogProbs | None = None,
    stop_reason: int | str | None = None,
    token_ids: list[int] | None = None,
    weight_versions: list[Any] | None = None,
) -> ChatCompletionResponseStreamChoice:
    """The choice of a choice's closing chunk."""
    return ChatCompletionResponseStreamChoice(
        index=index,
        delta=delta,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        token_ids=token_ids,
        weight_versions=weight_versions,
    )


def chat_usage_chunk(
    request_id: str, created: int, model: str, usage: UsageInfo, system_fingerprint: str | None
) -> ChatCompletionStreamResponse:
    """The closing chunk of `include_usage`: no choices, `final_stream_usage`."""
    return ChatCompletionStreamResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[],
        usage=usage,
        system_fingerprint=UNSET if system_fingerprint is None else system_fingerprint,
        kv_transfer_params=UNSET,
    )
