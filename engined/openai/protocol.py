"""vLLM 0.33's OpenAI request bodies as msgspec structs, and their decoding.

Every field vLLM's `CompletionRequest`, `ChatCompletionRequest`, `TokenizeCompletionRequest`
/ `TokenizeChatRequest`, `DetokenizeRequest` and `LoadLoRAAdapterRequest` /
`UnloadLoRAAdapterRequest` (the runtime LoRA routes) accept is here, with its name, default and
(nearly) its type, in vLLM's order (pydantic reports errors in that order). Unknown fields are
accepted and ignored, as vLLM does. Fields that shape only sampling (temperature, top_p,
penalties, ...) are typed and checked but change nothing in a simulated engine.

The objects inside a request are in `protocol_parts`. Where a type is looser than vLLM's, the
value is kept as JSON gave it: a named `tool_choice` and a message's content parts stay plain
objects (no tools or media here; vLLM's own checks on `tool_choice` run in
`protocol_checks`), and `prompt_embeds` stays the JSON string(s) (vLLM reads them as bytes;
this engine has no prompt embeddings).

`decode_*_request(body, content_type)` turns a POST body into a struct or raises `ApiError`
with vLLM's status, type, parameter and message: a body that is not JSON, a field of a wrong
type or out of range, and the checks vLLM's request models run before their fields
(`protocol_checks`). The sampling checks that need the prompt's length come later
(`protocol_sampling`).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeAlias

import msgspec
import msgspec.inspect as mi

from engined.openai import protocol_checks as checks
from engined.openai.api_errors import Errors, request_validation_error
from engined.openai.protocol_json import parse_body
from engined.openai.protocol_lax import (
    FAIL,
    FIELD_HOOKS,
    NOT_AN_OBJECT,
    STRUCT_CHECKS,
    UNION_FIELDS,
    UnionField,
    convert,
    register_literals,
    validate_struct,
)
from engined.openai.protocol_parts import (
    ChatCompletionToolsParam,
    ChatMessageParam,
    LegacyStructuralTagResponseFormat,
    RepetitionDetectionParams,
    ResponseFormat,
    StreamOptions,
    StructuralTagResponseFormat,
    StructuredOutputsParams,
    check_null_contents,
    check_repetition_detection,
    check_structured_outputs,
    message_not_an_object,
    request_not_an_object,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionToolsParam",
    "ChatMessageParam",
    "CompletionRequest",
    "DetokenizeRequest",
    "LoadLoRAAdapterRequest",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeRequest",
    "UnloadLoRAAdapterRequest",
    "decode_chat_request",
    "decode_completion_request",
    "decode_detokenize_request",
    "decode_load_lora_request",
    "decode_tokenize_request",
    "decode_unload_lora_request",
]

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
MAX_STOP_STRINGS: Final = 4

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Stop: TypeAlias = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None
XArgs: TypeAlias = dict[str, str | int | float | list[str | int | float]] | None


if TYPE_CHECKING:
    PromptInput: TypeAlias = str | list[int] | list[list[int]] | list[str] | None
    AnyResponseFormat: TypeAlias = (
        ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat | None
    )
else:
    # msgspec decodes no union of several list (or object) types; decoding checks these
    # (UnionField).
    PromptInput = Any
    AnyResponseFormat = Any


def _request_id() -> str:
    return uuid.uuid4().hex


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: PromptInput = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: Stop = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = []
    prompt_embeds: str | list[str] | None = None
    add_special_tokens: bool = True
    response_format: AnyResponseFormat = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: Int64 = 0
    request_id: str = msgspec.field(default_factory=_request_id)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: Annotated[int, msgspec.Meta(ge=0)] = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: XArgs = None
    repetition_detection: RepetitionDetectionParams | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    messages: list[ChatMessageParam]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: AnyResponseFormat = None
    seed: Int64 | None = None
    stop: Stop = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    thinking_token_budget: int | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: Int64 = 0
    request_id: str = msgspec.field(default_factory=_request_id)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: Annotated[int, msgspec.Meta(ge=0)] = 0
    return_token_offsets: bool | None = False
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: XArgs = None
    repetition_detection: RepetitionDetectionParams | None = None
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None


TokenizeRequest: TypeAlias = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def _struct(cls: type[msgspec.Struct]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    register_literals(cls)
    return info


_COMPLETION: Final = _struct(CompletionRequest)
_CHAT: Final = _struct(ChatCompletionRequest)
_TOKENIZE_PROMPT: Final = _struct(TokenizeCompletionRequest)
_TOKENIZE_CHAT: Final = _struct(TokenizeChatRequest)
_DETOKENIZE: Final = _struct(DetokenizeRequest)
_LOAD_LORA: Final = _struct(LoadLoRAAdapterRequest)
_UNLOAD_LORA: Final = _struct(UnloadLoRAAdapterRequest)
for _format in (ResponseFormat, StructuralTagResponseFormat, LegacyStructuralTagResponseFormat):
    register_literals(_format)
STRUCT_CHECKS[StructuredOutputsParams] = check_structured_outputs
STRUCT_CHECKS[RepetitionDetectionParams] = check_repetition_detection
NOT_AN_OBJECT[ChatMessageParam] = message_not_an_object
for _request in (CompletionRequest, ChatCompletionRequest):
    FIELD_HOOKS[(_request, "thinking_token_budget")] = checks.thinking_token_budget
FIELD_HOOKS[(ChatCompletionRequest, "top_logprobs")] = checks.top_logprobs

UNION_FIELDS[(CompletionRequest, "prompt")] = UnionField(
    list[TokenId], list[list[TokenId]], str, list[str], None
)
_RESPONSE_FORMAT: Final = UnionField(
    ResponseFormat, StructuralTagResponseFormat, LegacyStructuralTagResponseFormat, None
)
UNION_FIELDS[(CompletionRequest, "response_format")] = _RESPONSE_FORMAT
UNION_FIELDS[(ChatCompletionRequest, "response_format")] = _RESPONSE_FORMAT


def _root(body: bytes, content_type: str | None, t: mi.StructType | None) -> dict[str, Any]:
    """The parsed body as an object, or vLLM's refusal of a body that is none (`t` None: a
    tokenize request, whose two forms both refuse it)."""
    raw = parse_body(body, content_type)
    if type(raw) is not dict:
        errors = Errors()
        if raw is None:
            errors.add("missing", ("body",), "Field required", None)
        elif t is None:
            request_not_an_object(raw, ("body",), errors)
        else:
            validate_struct(raw, t, ("body",), errors)
        raise request_validation_error(errors)
    return raw


def decode_completion_request(
    body: bytes, content_type: str | None = "application/json"
) -> CompletionRequest:
    raw = checks.completion(_root(body, content_type, _COMPLETION))
    request: CompletionRequest = convert(raw, _COMPLETION)
    return request


def decode_chat_request(
    body: bytes, content_type: str | None = "application/json"
) -> ChatCompletionRequest:
    raw = checks.chat(_root(body, content_type, _CHAT))
    request: ChatCompletionRequest = convert(raw, _CHAT)
    check_null_contents(raw)
    return request


def decode_tokenize_request(
    body: bytes, content_type: str | None = "application/json"
) -> TokenizeRequest:
    """The prompt form or the messages form; with both valid, the messages form (as vLLM)."""
    raw = checks.tokenize(_root(body, content_type, None))
    errors = Errors()
    chat = validate_struct(raw, _TOKENIZE_CHAT, ("body",), None)
    if chat is not FAIL:
        assert isinstance(chat, TokenizeChatRequest)
        check_null_contents(raw)
        return chat
    prompt = validate_struct(raw, _TOKENIZE_PROMPT, ("body",), errors)
    if prompt is not FAIL:
        assert isinstance(prompt, TokenizeCompletionRequest)
        return prompt
    validate_struct(raw, _TOKENIZE_CHAT, ("body",), errors)
    raise request_validation_error(errors)


def decode_detokenize_request(
    body: bytes, content_type: str | None = "application/json"
) -> DetokenizeRequest:
    request: DetokenizeRequest = convert(_root(body, content_type, _DETOKENIZE), _DETOKENIZE)
    return request


def decode_load_lora_request(
    body: bytes, content_type: str | None = "application/json"
) -> LoadLoRAAdapterRequest:
    request: LoadLoRAAdapterRequest = convert(_root(body, content_type, _LOAD_LORA), _LOAD_LORA)
    return request


def decode_unload_lora_request(
    body: bytes, content_type: str | None = "application/json"
) -> UnloadLoRAAdapterRequest:
    raw = _root(body, content_type, _UNLOAD_LORA)
    request: UnloadLoRAAdapterRequest = convert(raw, _UNLOAD_LORA)
    return request
