"""The objects inside vLLM 0.33's requests: messages, stream options, tools, output formats.

A message is an object with a string `role` (vLLM takes custom roles) and text or a list of
parts as `content`, null only for the `assistant` role and a named `function` one; its parts
stay plain objects (no media here). `response_format` is vLLM's three-way union, and
`structured_outputs` and `repetition_detection` are vLLM's dataclasses, whose own checks
(`check_*` below) end validation as soon as they fail, as pydantic lets them. The engine
honours none of these; they are decoded to refuse what vLLM refuses.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from engined.openai.api_errors import Errors, Loc, request_validation_error, validation_error


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatMessageParam(msgspec.Struct, kw_only=True):
    """One message of `messages`: any role, text or parts."""

    role: str
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatCompletionToolsParam(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


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


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class RepetitionDetectionParams(msgspec.Struct, kw_only=True):
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """vLLM's `StructuredOutputsParams.__post_init__`: exactly one kind of constraint."""
    count = sum(getattr(params, name) is not None for name in _CONSTRAINTS)
    if count == 1:
        return
    fields = {name: getattr(params, name) for name in params.__struct_fields__}
    fields |= {"_backend": None, "_backend_was_auto": False}
    how = "multiple are specified" if count > 1 else "none are specified"
    message = f"You can only use one kind of structured outputs constraint but {how}: {fields}"
    if count < 1:
        message = f"You must use one kind of structured outputs constraint but {how}: {fields}"
    raise validation_error(message)


def check_repetition_detection(params: RepetitionDetectionParams) -> None:
    """vLLM's `RepetitionDetectionParams.__post_init__`."""
    largest, smallest = params.max_pattern_size, params.min_pattern_size
    if largest < 0 or smallest < 0 or smallest > largest:
        raise validation_error(
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
            "max_pattern_size. Set both to 0 to disable repetitive pattern detection."
        )
    if largest > 0 and params.min_count < 2:
        raise validation_error(
            "min_count must be >= 2 to detect repetitive patterns in engine output. If you "
            "do not wish to detect repetitive patterns, set max_pattern_size to 0."
        )


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


def message_not_an_object(value: object, loc: Loc, errors: Errors) -> None:
    for kind in _MESSAGE_KINDS:
        errors.add("dict_type", (*loc, kind), "Input should be a valid dictionary", value)
    msg = "Input should be a valid dictionary or object to extract fields from"
    errors.add("model_attributes_type", (*loc, "Message"), msg, value)


def request_not_an_object(value: object, loc: Loc, errors: Errors) -> None:
    """The body of a tokenize request: each of its two forms refuses it."""
    msg = "Input should be a valid dictionary or object to extract fields from"
    errors.add("model_attributes_type", loc, msg, value)
    errors.add("model_attributes_type", loc, msg, value)


def check_null_contents(raw: dict[str, Any]) -> None:
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
