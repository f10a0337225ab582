"""The checks vLLM 0.33's request models run on the raw body, before any field's type.

pydantic runs a model's `mode="before"` validators last-defined first, on the parsed JSON as
it came: a value is tested for truthiness (`"stream": "false"` counts as streaming here) and
compared before any coercion, and the first failure is the answer, whatever else is wrong. So
do these, in that order, and with vLLM's messages. Each returns the (possibly rewritten) body.

Left out: the structural-tag grammar checks (xgrammar; no structured output here), the
system-message content warning (a log line) and dropping `kv_transfer_params.prompt_token_ids`
beside media content (no media here). Where vLLM itself would crash on a malformed value
(a non-object `structured_outputs`, a named `tool_choice` beside a `tools` entry without a
function, a `tool_calls` that is a number), the value is left to the type checks, which
refuse it with a 400.
"""

from __future__ import annotations

from typing import Any, Final

from engined.openai.api_errors import validation_error

MAX_COMPLETION_PROMPTS: Final = 1024
MAX_CACHE_SALT_CHARS: Final = 128
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_TOOL_CHOICE_USAGE: Final = (
    'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
)

Body = dict[str, Any]


def _cache_salt(data: Body) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        message = "Parameter 'cache_salt' must be a non-empty string if provided."
        raise validation_error(message, param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        message = (
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL."
        )
        raise validation_error(message, param="cache_salt")


def _mm_payload_alias(data: Body) -> None:
    if data.get("return_mm_kwargs") is False and "mm_payload" not in data:
        data["mm_payload"] = "none"


def _stream_options(data: Body) -> None:
    if data.get("stream_options") and not data.get("stream"):
        message = "Stream options can only be defined when `stream=True`."
        raise validation_error(message, param="stream_options")


def _response_format(data: Body) -> None:
    response_format = data.get("response_format")
    if not isinstance(response_format, dict):
        return
    if response_format.get("type") == "json_schema" and response_format.get("json_schema") is None:
        message = (
            "When response_format type is 'json_schema', the 'json_schema' field must be provided."
        )
        raise validation_error(message, param="response_format")


def _structured_outputs(data: Body, *, chat: bool) -> None:
    constraints = data.get("structured_outputs")
    if not isinstance(constraints, dict):
        return
    count = sum(constraints.get(key) is not None for key in ("json", "regex", "choice"))
    if count > 1:
        message = (
            "You can only use one kind of constraints for structured outputs "
            "('json', 'regex' or 'choice')."
        )
        raise validation_error(message, param=None if chat else "structured_outputs")
    if chat and count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise validation_error(
            "You can only either use constraints for structured outputs or tools, not both."
        )


def _integer(data: Body, name: str) -> Any:
    value = data.get(name)
    if value is not None and not isinstance(value, int | float):
        raise validation_error(f"`{name}` must be an integer.", param=name, value=value)
    return value


def _prompt_logprobs(data: Body) -> None:
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        message = "`prompt_logprobs` are not available when `stream=True`."
        raise validation_error(message, param="prompt_logprobs")
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        message = "`prompt_logprobs` must be a positive value or -1."
        raise validation_error(message, param="prompt_logprobs", value=prompt_logprobs)


def _completion_logprobs(data: Body) -> None:
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        message = "`logprob_token_ids` is not supported with beam search."
        raise validation_error(message, param="logprob_token_ids")
    if data.get("use_beam_search") and data.get("echo") and data.get("logprobs") is not None:
        message = (
            "`echo` with `logprobs` is not supported with beam search because beam search "
            "does not compute prompt logprobs."
        )
        raise validation_error(message, param="echo")
    if data.get("logprob_token_ids") and data.get("echo") and data.get("max_tokens") == 0:
        message = (
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` "
            "because no output tokens are generated."
        )
        raise validation_error(message, param="logprob_token_ids")
    if data.get("logprob_token_ids") and data.get("logprobs") is None:
        message = "when using `logprob_token_ids`, `logprobs` must be set."
        raise validation_error(message, param="logprob_token_ids")
    _integer(data, "prompt_logprobs")
    logprobs = _integer(data, "logprobs")
    _prompt_logprobs(data)
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        message = "`logprobs` must be a positive value or -1."
        raise validation_error(message, param="logprobs", value=logprobs)


def _chat_logprobs(data: Body) -> None:
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        message = "`logprob_token_ids` is not supported with beam search."
        raise validation_error(message, param="logprob_token_ids")
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        message = "when using `logprob_token_ids`, `logprobs` must be set to true."
        raise validation_error(message, param="logprob_token_ids")
    _integer(data, "prompt_logprobs")
    top_logprobs = _integer(data, "top_logprobs")
    _prompt_logprobs(data)
    if top_logprobs is None:
        return
    if top_logprobs < 0 and top_logprobs != -1:
        message = "`top_logprobs` must be a positive value or -1."
        raise validation_error(message, param="top_logprobs", value=top_logprobs)
    if (top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs"):
        message = "when using `top_logprobs`, `logprobs` must be set to true."
        raise validation_error(message, param="top_logprobs")


def _prompt(data: Body) -> None:
    prompt = data.get("prompt")
    if (
        isinstance(prompt, list)
        and len(prompt) > MAX_COMPLETION_PROMPTS
        and not isinstance(prompt[0], int)
    ):
        message = (
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
            "VLLM_MAX_COMPLETION_PROMPTS environment variable."
        )
        raise validation_error(message, param="prompt")
    embeds = data.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > MAX_COMPLETION_PROMPTS:
        message = (
            f"prompt_embeds list length {len(embeds)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
            "VLLM_MAX_COMPLETION_PROMPTS environment variable."
        )
        raise validation_error(message, param="prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        message = "Either prompt or prompt_embeds must be provided and non-empty."
        raise validation_error(message, param="prompt")


def thinking_token_budget(budget: object) -> object:
    """The field's own validator: an integer >= 0, or -1 (or null) for none."""
    if budget is None:
        return None
    if type(budget) is not int or budget < -1:
        message = "`thinking_token_budget` must be a non-negative integer or -1 for unlimited."
        raise validation_error(message, param="thinking_token_budget", value=budget)
    return None if budget == -1 else budget


def top_logprobs(value: object) -> object:
    """The field's own validator: null means 0."""
    return 0 if value is None else value


def _generation_prompt(data: Body) -> None:
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


def _named_tool(data: Body, choice: dict[str, Any]) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        message = f"Invalid value for `function`: `{function}` in `tool_choice`! "
        raise validation_error(message + _TOOL_CHOICE_USAGE, param="tool_choice.function")
    if "name" not in function:
        message = "Expected field `name` in `function` in `tool_choice`! "
        raise validation_error(message + _TOOL_CHOICE_USAGE, param="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        message = f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
        raise validation_error(message + _TOOL_CHOICE_USAGE, param="tool_choice.function.name")
    tools = data["tools"]
    if not isinstance(tools, list) or not all(
        isinstance(tool, dict) and isinstance(tool.get("function"), dict) for tool in tools
    ):
        return
    if not any(tool["function"].get("name") == name for tool in tools):
        message = "The tool specified in `tool_choice` does not match any of the specified `tools`"
        raise validation_error(message, param="tool_choice")


def _tools(data: Body) -> None:
    if data.get("tools") == []:
        message = (
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely."
        )
        raise validation_error(message, param="tools")
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"
    choice = data.get("tool_choice")
    if choice == "none" or choice is None:
        return
    if data.get("tools") is None:
        raise validation_error(
            "When using `tool_choice`, `tools` must be set.", param="tool_choice"
        )
    if isinstance(choice, dict):
        _named_tool(data, choice)
    elif choice not in ("auto", "required"):
        message = (
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.'
        )
        raise validation_error(message, param="tool_choice")


def _messages(data: Body) -> None:
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, str | dict):
            message["tool_calls"] = list(tool_calls)
        reasoning = message.pop("reasoning_content", None)
        if reasoning is not None and message.get("reasoning") is None:
            message["reasoning"] = reasoning


def completion(data: Body) -> Body:
    _prompt(data)
    _stream_options(data)
    _completion_logprobs(data)
    _structured_outputs(data, chat=False)
    _response_format(data)
    if data.get("max_tokens") is None:
        data["max_tokens"] = 16
    _cache_salt(data)
    _mm_payload_alias(data)
    return data


def chat(data: Body) -> Body:
    _generation_prompt(data)
    _tools(data)
    _structured_outputs(data, chat=True)
    _chat_logprobs(data)
    _stream_options(data)
    _response_format(data)
    _messages(data)
    _cache_salt(data)
    _mm_payload_alias(data)
    return data


def tokenize(data: Body) -> Body:
    _generation_prompt(data)
    return data
