"""Pydantic's lax rules for single values, as vLLM 0.33's request models run them: numbers,
booleans, strings, literals and None (`engined.openai.protocol_lax` walks the containers).

Apart because each rule here fails with exactly one error and calls no other rule, so the
text of pydantic's messages for them reads in one place; `FAIL` is what every rule returns
for a value that did not validate.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from engined.openai.api_errors import Errors, Loc

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_FLOAT_TEXT = re.compile(
    r"[+-]?(?:[0-9]+(?:_[0-9]+)*(?:\.(?:[0-9]+(?:_[0-9]+)*)?)?|\.[0-9]+(?:_[0-9]+)*)"
    r"(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)",
    re.IGNORECASE,
)
_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})


class Fail:
    """The result of a value that did not validate."""


FAIL: Final = Fail()


# msgspec.inspect sorts a Literal's values; pydantic's message lists them as declared.
_LITERAL_ORDER: dict[tuple[object, ...], tuple[object, ...]] = {}


def register_literals(annotation: object) -> None:
    """Remember the declared order of every Literal in `annotation` (a struct: its fields)."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        for hint in typing.get_type_hints(annotation, include_extras=True).values():
            register_literals(hint)
        return
    if typing.get_origin(annotation) is typing.Literal:
        values = typing.get_args(annotation)
        _LITERAL_ORDER[tuple(sorted(values, key=str))] = values
        return
    for arg in typing.get_args(annotation):
        register_literals(arg)


def to_int(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    return _bounded(_int(value, loc, errors, strict), t, loc, errors, value)


def _int(value: object, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if type(value) is int:
        return value
    if strict:
        return fail(errors, "int_type", loc, "Input should be a valid integer", value)
    if type(value) is bool:
        return int(value)
    if type(value) is float:
        if not math.isfinite(value):
            return fail(errors, "finite_number", loc, "Input should be a finite number", value)
        if not value.is_integer():
            msg = "Input should be a valid integer, got a number with a fractional part"
            return fail(errors, "int_from_float", loc, msg, value)
        if not _INT64_MIN <= value <= _INT64_MAX:
            msg = "Unable to parse input string as an integer, exceeded maximum size"
            return fail(errors, "int_parsing_size", loc, msg, value)
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text.partition(".")[0])
        msg = "Input should be a valid integer, unable to parse string as an integer"
        return fail(errors, "int_parsing", loc, msg, value)
    return fail(errors, "int_type", loc, "Input should be a valid integer", value)


def to_float(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    if not strict and type(value) is bool:
        return float(value)
    if not strict and isinstance(value, str):
        text = value.strip()
        if _FLOAT_TEXT.fullmatch(text):
            return float(text)
        msg = "Input should be a valid number, unable to parse string as a number"
        return fail(errors, "float_parsing", loc, msg, value)
    return fail(errors, "float_type", loc, "Input should be a valid number", value)


def to_bool(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if type(value) is bool:
        return value
    if not strict:
        if isinstance(value, str):
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
        number = int(value) if type(value) is float and value.is_integer() else value
        if type(number) is int and _INT64_MIN <= number <= _INT64_MAX:
            if number in (0, 1):
                return number == 1
            msg = "Input should be a valid boolean, unable to interpret input"
            return fail(errors, "bool_parsing", loc, msg, value)
        if isinstance(value, str):
            msg = "Input should be a valid boolean, unable to interpret input"
            return fail(errors, "bool_parsing", loc, msg, value)
    return fail(errors, "bool_type", loc, "Input should be a valid boolean", value)


def fail(
    errors: Errors | None, kind: str, loc: Loc, msg: str, value: object, **ctx: object
) -> Fail:
    if errors is not None:
        errors.add(kind, loc, msg, value, **ctx)
    return FAIL


def _bounded(result: object, t: mi.IntType, loc: Loc, errors: Errors | None, raw: object) -> object:
    if not isinstance(result, int):
        return result
    if t.ge is not None and result < t.ge:
        msg = f"Input should be greater than or equal to {t.ge}"
        return fail(errors, "greater_than_equal", loc, msg, raw, ge=t.ge)
    if t.le is not None and result > t.le:
        msg = f"Input should be less than or equal to {t.le}"
        return fail(errors, "less_than_equal", loc, msg, raw, le=t.le)
    return result


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def to_str(value: object, t: mi.StrType, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if not isinstance(value, str):
        return fail(errors, "string_type", loc, "Input should be a valid string", value)
    if t.min_length is not None and len(value) < t.min_length:
        msg = f"String should have at least {plural(t.min_length, 'character')}"
        return fail(errors, "string_too_short", loc, msg, value, min_length=t.min_length)
    if t.max_length is not None and len(value) > t.max_length:
        msg = f"String should have at most {plural(t.max_length, 'character')}"
        return fail(errors, "string_too_long", loc, msg, value, max_length=t.max_length)
    return value


def to_literal(
    value: object, t: mi.LiteralType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if value in t.values and type(value) is str:
        return value
    declared = _LITERAL_ORDER.get(tuple(sorted(t.values, key=str)), t.values)
    quoted = [repr(v) for v in declared]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    msg = f"Input should be {expected}"
    return fail(errors, "literal_error", loc, msg, value, expected=expected)


def none_rule(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if value is None:
        return None
    return fail(errors, "none_required", loc, "Input should be None", value)
