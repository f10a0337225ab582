"""Decoding's two paths agree: msgspec's strict one is only a faster way to pydantic's lax one.

Every body decodes as the lax validator alone would decode it (the same struct, or the same
refusal), whichever path took it; and the lax rules are pydantic's on the values pydantic
coerces, as recorded from pydantic 2.14 (what vLLM 0.33 runs).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engined.openai import protocol_checks as checks
from engined.openai.api_errors import ApiError, Errors, request_validation_error
from engined.openai.protocol import ChatCompletionRequest, CompletionRequest
from engined.openai.protocol import decode_chat_request as decode_chat
from engined.openai.protocol import decode_completion_request as decode_completion
from engined.openai.protocol_lax import FAIL, validate, validate_struct

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "x", "12", " 7 ", "1.0", "1.5", "true", "off", "1e3", "left", "none"]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.lists(st.lists(SCALARS, max_size=3)))
COMPLETION_FIELDS = [
    "max_tokens", "n", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed",
    "echo", "stream", "min_tokens", "priority", "user", "logit_bias", "ignore_eos", "prompt",
    "truncation_side", "min_p", "skip_special_tokens", "bad_words", "suffix",
]  # fmt: skip
CHAT_FIELDS = [
    "max_tokens", "max_completion_tokens", "n", "temperature", "stop", "seed", "echo",
    "stream", "min_tokens", "logprobs", "reasoning_effort", "add_generation_prompt",
    "include_reasoning", "parallel_tool_calls", "documents",
]  # fmt: skip


def _outcome(decode: Any, body: bytes) -> object:
    try:
        return decode(body)
    except ApiError as error:
        return (error.status, error.body())


def _lax(raw: dict[str, Any], cls: type, before: Any) -> object:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    try:
        raw = before(raw)
        errors = Errors()
        result = validate_struct(raw, info, ("body",), errors)
        if result is FAIL:
            raise request_validation_error(errors)
        return result
    except ApiError as error:
        return (error.status, error.body())


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(COMPLETION_FIELDS), VALUES, max_size=6))
def test_completion_paths_agree(fields: dict[str, Any]) -> None:
    raw = {"prompt": "p", "request_id": "r", **fields}
    body = json.dumps(raw).encode()
    assert _outcome(decode_completion, body) == _lax(
        json.loads(body), CompletionRequest, checks.completion
    )


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(CHAT_FIELDS), VALUES, max_size=5))
def test_chat_paths_agree(fields: dict[str, Any]) -> None:
    raw = {"messages": [{"role": "user", "content": "hi"}], "request_id": "r", **fields}
    body = json.dumps(raw).encode()
    assert _outcome(decode_chat, body) == _lax(json.loads(body), ChatCompletionRequest, checks.chat)


def _lax_value(value: object, annotation: Any) -> object:
    errors = Errors()
    result = validate(value, mi.type_info(annotation), ("x",), errors)
    return errors.kept[0]["type"] if result is FAIL else result


@pytest.mark.parametrize(
    ("value", "as_int", "as_float", "as_bool"),
    [
        ("12", 12, 12.0, "bool_parsing"),
        (" 12 ", 12, 12.0, "bool_parsing"),
        ("1_000", 1000, 1000.0, "bool_parsing"),
        ("12.00", 12, 12.0, "bool_parsing"),
        ("12.", "int_parsing", 12.0, "bool_parsing"),
        ("1e3", "int_parsing", 1000.0, "bool_parsing"),
        ("Infinity", "int_parsing", float("inf"), "bool_parsing"),
        ("yes", "int_parsing", "float_parsing", True),
        ("OFF", "int_parsing", "float_parsing", False),
        (" true", "int_parsing", "float_parsing", "bool_parsing"),
        ("\u0663", "int_parsing", "float_parsing", "bool_parsing"),
        (True, 1, 1.0, True),
        (2.0, 2, 2.0, "bool_parsing"),
        (1.5, "int_from_float", 1.5, "bool_type"),
        (1e20, "int_parsing_size", 1e20, "bool_type"),
        (2, 2, 2.0, "bool_parsing"),
        (2**70, 2**70, float(2**70), "bool_type"),
        (None, "int_type", "float_type", "bool_type"),
        ([1], "int_type", "float_type", "bool_type"),
    ],
)
def test_scalar_coercions_are_pydantics(
    value: object, as_int: object, as_float: object, as_bool: object
) -> None:
    assert (_lax_value(value, int), _lax_value(value, float), _lax_value(value, bool)) == (
        as_int,
        as_float,
        as_bool,
    )


def test_an_error_shows_the_value_as_sent() -> None:
    errors = Errors()
    validate(2.0, mi.type_info(bool), ("body", "echo"), errors)
    assert errors.kept == [
        {
            "type": "bool_parsing",
            "loc": ("body", "echo"),
            "msg": "Input should be a valid boolean, unable to interpret input",
            "input": 2.0,
        }
    ]
