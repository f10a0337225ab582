"""The errors an OpenAI client of vLLM 0.33 meets, as bodies and as stream events.

vLLM answers a failed request with `{"error": {"message", "type", "param", "code"}}` and the
status in `code`; its own validation errors (`VLLMValidationError`) name the field in `param`
and append `(parameter=..., value=...)` to the message; its admission-control refusals carry
the HTTP reason phrase as `type`; and FastAPI's own refusals (an unparsable body, an unknown
route) answer `{"detail": ...}` instead. A streamed request that fails after its 200 ends
with one `data:` event carrying the error body and `data: [DONE]`; completions write that
event with `json.dumps`' spaced separators and ASCII escapes, chat with compact JSON.

Every message passes through vLLM's sanitizer (no addresses, tracebacks or file paths), as
vLLM's handlers apply it to every error they build.

A body pydantic refuses is answered with all its errors counted ("N validation errors:") and
the first 10 printed, each as pydantic's error dict with its location joined by dots and its
input summarized, the type "Bad Request" and the first error's location as `param`:
`Errors` collects them, `request_validation_error` renders them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final

import msgspec

BAD_REQUEST: Final = "BadRequestError"
KEPT_ERRORS: Final = 10
_INPUT_CHARS: Final = 200
_LINE_CHARS: Final = 1000
# Location segments vLLM's handler drops from `param` and from the printed locations.
_INTERNAL_SEGMENTS: Final = frozenset([
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
    "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
    "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
    "nonetype",
])  # fmt: skip
_BRACKETS = re.compile(r"[\[\]{}()]")

Loc = tuple[str | int, ...]


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


_encode = msgspec.json.Encoder().encode

_SANITIZE: Final = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize(message: str) -> str:
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


class ApiError(Exception):
    """A request's failure: raise it anywhere below a handler, answer with `body()`."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None) -> None:
        self.status = status
        self.message = sanitize(message)
        self.type = type
        self.param = param
        super().__init__(self.message)

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)

    def body(self) -> bytes:
        """The response body, byte for byte as vLLM's `JSONResponse(err.model_dump())`."""
        return _encode(ErrorResponse(error=self.info()))

    def stream_event(self, *, chat: bool) -> bytes:
        """The `data:` event a stream that already answered 200 ends with (before `[DONE]`)."""
        if chat:
            data = self.body()
        else:
            data = json.dumps({"error": msgspec.to_builtins(self.info())}).encode()
        return b"data: " + data + b"\n\n"


class GenerationFailure(ApiError):
    """vLLM's `GenerationError`s (a failed or retryable generation): a chat stream renders
    every one as "InternalServerError" with the error's own status, whatever its type."""

    def stream_event(self, *, chat: bool) -> bytes:
        if not chat:
            return super().stream_event(chat=False)
        internal = ApiError(self.status, self.message, "InternalServerError")
        return internal.stream_event(chat=True)


class DetailError(ApiError):
    """A refusal FastAPI makes itself, which vLLM's handlers never reshape: `{"detail": ...}`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(status, detail, "")
        self.detail = detail

    def body(self) -> bytes:
        return _encode({"detail": self.detail})


def _suffix(param: str | None, value: object) -> str:
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    return f" ({', '.join(extras)})" if extras else ""


def validation_error(message: str, *, param: str | None = None, value: object = None) -> ApiError:
    """vLLM's `VLLMValidationError`: 400, and its parameter and value appended to the text."""
    return ApiError(400, message + _suffix(param, value), BAD_REQUEST, param)


def value_error(message: str) -> ApiError:
    """A plain `ValueError` out of vLLM's request path: 400 without a parameter."""
    return ApiError(400, message, BAD_REQUEST)


def http_error(status: int, message: str) -> ApiError:
    """vLLM's answer to an HTTPException: the reason phrase as `type`, no parameter. The shape
    for the HTTP server's own refusals (its `ErrorFactory`)."""
    return ApiError(status, message, HTTPStatus(status).phrase)


def unsupported_media_type() -> ApiError:
    """A POST whose Content-Type is not `application/json` (any parameters, any case)."""
    message = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    return ApiError(400, message, "Bad Request")


def body_parse_error() -> DetailError:
    """A body FastAPI cannot read as JSON text at all (not UTF-8, nested too deep)."""
    return DetailError(400, "There was an error parsing the body")


def route_not_found() -> DetailError:
    return DetailError(404, "Not Found")


def method_not_allowed() -> DetailError:
    return DetailError(405, "Method Not Allowed")


def model_not_found(name: str, served: Sequence[str]) -> ApiError:
    """A `model` field naming none of the served names (an absent or empty one is the default)."""
    message = f"The model `{name}` does not exist. Valid aliases: {', '.join(served)}."
    return ApiError(404, message, "NotFoundError", "model")


def engine_overloaded() -> ApiError:
    """vLLM's `QueueOverflowError`: the engine holds as many requests as it admits."""
    message = (
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance."
    )
    return ApiError(503, message, "Service Unavailable")


def prefill_backlog_full() -> ApiError:
    """vLLM's `MaxQueuedTokensError`: too many prompt tokens still wait for prefill."""
    message = (
        "The engine has reached its prefill token backlog limit. "
        "Please try again later or on a different instance."
    )
    return ApiError(503, message, "Service Unavailable")


def engine_dead() -> ApiError:
    """What clients see once the engine is gone (vLLM's `EngineDeadError.CLIENT_MESSAGE`)."""
    return ApiError(
        500, "The server had an error while processing your request.", "InternalServerError"
    )


def generation_error() -> ApiError:
    """A request the engine ended with an error (`finish_reason == "error"`)."""
    return GenerationFailure(500, "Internal server error", "InternalServerError")


def generation_paused(message: str) -> GenerationFailure:
    """vLLM's `RetryableRequestError` for a request the engine refused while generation is
    paused (abort or wait mode): a 503 the client may retry after the resume."""
    return GenerationFailure(503, message, "ServiceUnavailableError")


def beam_search_stream() -> ApiError:
    """A streamed completion asking for beam search, refused before even the model check."""
    return value_error("Streaming is not currently supported with beam search")


def empty_prompt() -> ApiError:
    """A prompt of no tokens reaching the engine (`[[]]`; `""` and `[]` are caught earlier)."""
    return validation_error("The decoder prompt cannot be empty")


def token_out_of_vocabulary(token_id: int, *, param: str | None = None) -> ApiError:
    """A prompt token id outside the vocabulary: the lowest when negative, else the highest."""
    return validation_error(f"Token id {token_id} is out of vocabulary", param=param)


def prompt_chars_error(max_model_len: int, chars: int, max_chars_per_token: int) -> ApiError:
    """A text prompt longer than `max_model_len` tokens could ever hold, refused untokenized."""
    limit = max_model_len * max_chars_per_token
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {chars} characters (more than {limit} characters, which is the upper bound "
        f"for {max_model_len} input tokens). Please reduce the length of the input prompt."
    )
    return validation_error(message, param="input_text", value=chars)


def context_length_error(
    max_model_len: int,
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    max_tokens_param: str = "max_tokens",
    truncate_prompt_tokens: int | None = None,
    from_text: bool = False,
) -> ApiError | None:
    """vLLM 0.33's refusal of a request that does not fit the context, or None if it fits.

    In vLLM's order: an output budget alone over `max_model_len`, a truncation size over it
    (both before tokenizing), then a prompt (after truncation) over it. A text prompt is
    tokenized to at most `max_model_len + 1` tokens, hence `from_text` and vLLM's "at least".
    A prompt plus `max_tokens` over the context is no error in vLLM 0.33: `max_tokens`
    shrinks to what is left (`effective_max_tokens`), and a prompt that fills the context
    leaves 0, which the sampling checks refuse. `max_tokens` is what the request asked (chat:
    `max_completion_tokens` if set, else `max_tokens`, and `max_tokens_param` names which;
    completions: `max_tokens or 0`).
    """
    if max_tokens is not None and max_tokens > max_model_len:
        message = (
            f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len="
            f"{max_model_len}. Please request fewer output tokens."
        )
        return validation_error(message, param=max_tokens_param, value=max_tokens)
    if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:
        message = (
            f"truncate_prompt_tokens={truncate_prompt_tokens} cannot be greater than "
            f"max_model_len = {max_model_len}. Please request a smaller truncation size."
        )
        return validation_error(
            message, param="truncate_prompt_tokens", value=truncate_prompt_tokens
        )
    count = min(prompt_tokens, max_model_len + 1) if from_text else prompt_tokens
    if count > max_model_len:
        qualifier = "at least " if count == max_model_len + 1 else ""
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt."
        )
        return validation_error(message, param="input_tokens", value=count)
    return None


class Errors:
    """One validation's errors: all counted, the first `KEPT_ERRORS` kept as pydantic's dicts."""

    __slots__ = ("count", "kept")

    def __init__(self) -> None:
        self.count = 0
        self.kept: list[dict[str, Any]] = []

    def add(self, kind: str, loc: Loc, msg: str, value: object, **ctx: object) -> None:
        self.count += 1
        if len(self.kept) < KEPT_ERRORS:
            error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
            if ctx:
                error["ctx"] = ctx
            self.kept.append(error)

    def merge(self, other: Errors) -> None:
        self.count += other.count
        self.kept.extend(other.kept[: KEPT_ERRORS - len(self.kept)])


def _summarize(value: object) -> object:
    """vLLM's bounded stand-in for an error's input: containers described, text cut at 200."""
    if isinstance(value, str):
        return value[:_INPUT_CHARS] + "...[truncated]" if len(value) > _INPUT_CHARS else value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:
        return f"<{type(value).__name__}>"
    return text[:_INPUT_CHARS] + "...[truncated]" if len(text) > _INPUT_CHARS else text


def param_of(loc: Loc) -> str:
    parts = [
        str(p)
        for p in loc
        if not _BRACKETS.search(str(p)) and str(p).lower() not in _INTERNAL_SEGMENTS
    ]
    return ".".join(parts if parts else [str(p) for p in loc])


def _line(error: Mapping[str, Any]) -> str:
    shown = dict(error)
    shown["input"] = _summarize(shown["input"])
    shown["loc"] = param_of(shown["loc"])
    text = str(shown)
    return text[:_LINE_CHARS] + "...[truncated]" if len(text) > _LINE_CHARS else text


def request_validation_error(errors: Errors) -> ApiError:
    """vLLM's answer to a body its request model refuses (FastAPI's RequestValidationError)."""
    label = "error" if errors.count == 1 else "errors"
    message = f"{errors.count} validation {label}:\n"
    message += "".join(f"  {_line(error)}\n" for error in errors.kept)
    if errors.count > len(errors.kept):
        message += f"  ...and {errors.count - len(errors.kept)} more {label}\n"
    param = param_of(errors.kept[0]["loc"]) if errors.kept else None
    return ApiError(400, message.rstrip(), "Bad Request", param)
