"""vLLM 0.33's OpenAI request bodies as msgspec structs, and their decoding.

Every field vLLM's `CompletionRequest`, `ChatCompletionRequest`, `TokenizeCompletionRequest`
/ `TokenizeChatRequest` and `DetokenizeRequest` accept is here, with its name, default and
(nearly) its type, in vLLM's order (pydantic reports errors in that order). Unknown fields are
accepted and ignored, as vLLM does. Fields that shape only sampling (temperature, top_p,
penalties, ...) are typed and checked but change nothing in a simulated engine.

Where a type is looser than vLLM's, the value is kept as JSON gave it and vLLM's own checks on
it run in `protocol_checks` or not at all: `structured_outputs`, `tools`, `tool_choice`,
`repetition_detection` and the content parts of a message stay plain objects (no structured
output, tools or media here); `prompt_embeds` stays the JSON string(s) (vLLM reads them as
bytes; this engine has no prompt embeddings). A message is an object with a string `role`
(vLLM takes custom roles) and text or a list of parts as `content`, null only for the
`assistant` role and a named `function` one.

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
from engined.openai.errors import Errors, Loc, request_validation_error
from engined.openai.protocol_json import parse_body
from engined.openai.protocol_lax import (
    FAIL,
    NOT_AN_OBJECT,
    UNION_FIELDS,
    UnionField,
    convert,
    register_literals,
    validate_struct,
)

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
MAX_STOP_STRINGS: Final = 4

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Stop: TypeAlias = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None
XArgs: TypeAlias = dict[str, str | int | float | list[str | int | float]] | None


class JsonSchemaResponseFormat(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuralTagResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["structural_tag"]
    format: Any


class LegacyStructuralTag(msgspec.Struct, kw_only=True):
    begin: str
    structural_tag_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    end: str


class LegacyStructuralTagResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["structural_tag"]
    structures: list[LegacyStructuralTag]
    triggers: list[str]


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


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatMessageParam(msgspec.Struct, kw_only=True):
    """One message of `messages`: any role (vLLM accepts custom roles), text or parts."""

    role: str
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None


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
    structured_outputs: dict[str, Any] | None = None
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
    repetition_detection: dict[str, Any] | None = None
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
    tools: list[dict[str, Any]] | None = None
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
    structured_outputs: dict[str, Any] | None = None
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
    repetition_detection: dict[str, Any] | None = None
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
    tools: list[dict[str, Any]] | None = None


TokenizeRequest: TypeAlias = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]]


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
for _format in (ResponseFormat, StructuralTagResponseFormat, LegacyStructuralTagResponseFormat):
    register_literals(_format)

UNION_FIELDS[(CompletionRequest, "prompt")] = UnionField(
    list[TokenId], list[list[TokenId]], str, list[str], None
)
_RESPONSE_FORMAT: Final = UnionField(
    ResponseFormat, StructuralTagResponseFormat, LegacyStructuralTagResponseFormat, None
)
UNION_FIELDS[(CompletionRequest, "response_format")] = _RESPONSE_FORMAT
UNION_FIELDS[(ChatCompletionRequest, "response_format")] = _RESPONSE_FORMAT

# Each member of vLLM's message union refuses a message that is not an object, in turn.
_MESSAGE_KINDS: Final = (
    "ChatCompletionDeveloperMessageParam",
    "ChatCompletionSystemMessageParam",
    "ChatCompletionUserMessageParam",
    "ChatCompletionAssistantMessageParam",
    "ChatCompletionToolMessageParam",
    "ChatCompletionFunctionMessageParam",
    "CustomChatCompletionMessageParam",
)


def _message_not_an_object(value: object, loc: Loc, errors: Errors) -> None:
    for kind in _MESSAGE_KINDS:
        errors.add("dict_type", (*loc, kind), "Input should be a valid dictionary", value)
    msg = "Input should be a valid dictionary or object to extract fields from"
    errors.add("model_attributes_type", (*loc, "Message"), msg, value)


NOT_AN_OBJECT[ChatMessageParam] = _message_not_an_object


def _check_null_contents(raw: dict[str, Any]) -> None:
    """vLLM's message union takes a null `content` only from an assistant or named function."""
    errors = Errors()
    for index, message in enumerate(raw["messages"]):
        if "content" not in message or message["content"] is not None:
            continue
        role, name = message.get("role"), message.get("name")
        if role == "assistant" or (role == "function" and isinstance(name, str)):
            continue
        loc = ("body", "messages", index, "content")
        errors.add("string_type", loc, "Input should be a valid string", None)
    if errors.count:
        raise request_validation_error(errors)


def _root(body: bytes, content_type: str | None, t: mi.StructType) -> dict[str, Any]:
    """The parsed body as an object, or vLLM's refusal of a body that is none."""
    raw = parse_body(body, content_type)
    if type(raw) is not dict:
        errors = Errors()
        if raw is None:
            errors.add("missing", ("body",), "Field required", None)
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
    _check_null_contents(raw)
    return request


def decode_tokenize_request(
    body: bytes, content_type: str | None = "application/json"
) -> TokenizeRequest:
    """The prompt form or the messages form; with both valid, the messages form (as vLLM)."""
    raw = checks.tokenize(_root(body, content_type, _TOKENIZE_CHAT))
    errors = Errors()
    chat = validate_struct(raw, _TOKENIZE_CHAT, ("body",), None)
    if chat is not FAIL:
        assert isinstance(chat, TokenizeChatRequest)
        _check_null_contents(raw)
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
