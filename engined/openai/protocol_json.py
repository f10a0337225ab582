"""A POST body read as vLLM's FastAPI app reads it, refusals included.

FastAPI parses the body with `json.loads` when its Content-Type is JSON (`application/json`
or `application/*+json`, any case and parameters), before vLLM's own dependency refuses any
media type but `application/json`; an empty body is no body. So a malformed JSON body meets a
`json_invalid` validation error naming the character offset and `json`'s message, a body
`json` cannot even read (not UTF-8, nested too deep, an integer of more than 4300 digits)
meets FastAPI's `{"detail": "There was an error parsing the body"}`, and a wrong media type
meets vLLM's "Unsupported Media Type". msgspec parses first, for speed; whatever it refuses
goes to `json.loads`, which also takes what msgspec does not (a UTF-8 BOM, UTF-16/32,
`NaN`, `1e400`), as vLLM does. One refusal is this engine's own: a string holding an
unpaired UTF-16 surrogate (`"\\ud800"`), which `json` reads and vLLM accepts, cannot be
tokenized or written back as UTF-8, so it meets the unreadable-body answer.
"""

from __future__ import annotations

import email.message
import json
from typing import Final

import msgspec

from engined.openai.api_errors import (
    Errors,
    body_parse_error,
    request_validation_error,
    unsupported_media_type,
)

JSON_MEDIA_TYPE: Final = "application/json"

_decode = msgspec.json.Decoder().decode


def _is_json(content_type: str | None) -> bool:
    if content_type == JSON_MEDIA_TYPE:
        return True
    if not content_type:
        return False
    header = email.message.Message()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _has_lone_surrogate(value: object) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _loads(body: bytes) -> object:
    try:
        return _decode(body)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError as error:
        errors = Errors()
        errors.add("json_invalid", ("body", error.pos), "JSON decode error", {}, error=error.msg)
        raise request_validation_error(errors) from None
    except (ValueError, RecursionError):
        raise body_parse_error() from None
    if _has_lone_surrogate(parsed):
        raise body_parse_error()
    return parsed


def read_body(body: bytes, content_type: str | None) -> object:
    """The body's JSON value as FastAPI reads a route's `Body` parameters: None when empty or
    of another media type (no media-type refusal: vLLM's RL routes have no such check)."""
    return _loads(body) if body and _is_json(content_type) else None


def parse_body(body: bytes, content_type: str | None) -> object:
    """The body's JSON value (None when empty), or the ApiError vLLM answers it with."""
    parsed = _loads(body) if body and _is_json(content_type) else None
    if (content_type or "").lower().split(";", 1)[0] != JSON_MEDIA_TYPE:
        raise unsupported_media_type()
    return parsed
