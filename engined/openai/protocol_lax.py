"""Pydantic's lax validation, as vLLM 0.33's request models run it.

Decoding tries msgspec's strict conversion first; a body it refuses comes here, where every
field is validated the way pydantic 2 does in Python mode (what FastAPI runs on the parsed
JSON): `"12"`, `12.0` and `true` are integers, `"yes"` and `1` are booleans, `"1e3"` is a
number, unions try each member strictly and then laxly and report every member's errors.
What fails is collected as pydantic's error dicts and reported as vLLM reports them
(`errors.request_validation_error`).

The types come from `msgspec.inspect` of the request structs, so a field is declared once.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from engined.openai.api_errors import KEPT_ERRORS, Errors, Loc, request_validation_error

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


class _Fail:
    """The result of a value that did not validate."""


FAIL: Final = _Fail()


# What a struct reports when its value is not an object; pydantic models say this by default.
NotAnObject = Callable[[object, Loc, Errors], None]


def _model_attributes_type(value: object, loc: Loc, errors: Errors) -> None:
    msg = "Input should be a valid dictionary or object to extract fields from"
    errors.add("model_attributes_type", loc, msg, value)


NOT_AN_OBJECT: dict[type, NotAnObject] = {}


class UnionField:
    """A field msgspec cannot type (a union of several list types): its members, in order."""

    def __init__(self, *members: Any) -> None:
        self.members = members
        self.type = mi.UnionType(types=tuple(mi.type_info(m) for m in members))
        _STRICT_UNIONS[id(self.type)] = self

    def strict(self, value: object) -> object:
        """The first member `value` converts to strictly (msgspec's speed), or FAIL."""
        for member in self.members:
            try:
                return msgspec.convert(value, member, strict=True)
            except (msgspec.ValidationError, UnicodeEncodeError):
                continue
        return FAIL


UNION_FIELDS: dict[tuple[type, str], UnionField] = {}
_STRICT_UNIONS: dict[int, UnionField] = {}
# A field's own before-validator: its raw value in, the value to validate out, or ApiError.
FIELD_HOOKS: dict[tuple[type, str], Callable[[object], object]] = {}
# A struct's own checks once its fields are valid (a dataclass's __post_init__): ApiError.
STRUCT_CHECKS: dict[type, Callable[[Any], None]] = {}
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


def _to_int(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    return _bounded(_int(value, loc, errors, strict), t, loc, errors, value)


def _int(value: object, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if type(value) is int:
        return value
    if strict:
        return _fail(errors, "int_type", loc, "Input should be a valid integer", value)
    if type(value) is bool:
        return int(value)
    if type(value) is float:
        if not math.isfinite(value):
            return _fail(errors, "finite_number", loc, "Input should be a finite number", value)
        if not value.is_integer():
            msg = "Input should be a valid integer, got a number with a fractional part"
            return _fail(errors, "int_from_float", loc, msg, value)
        if not _INT64_MIN <= value <= _INT64_MAX:
            msg = "Unable to parse input string as an integer, exceeded maximum size"
            return _fail(errors, "int_parsing_size", loc, msg, value)
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text.partition(".")[0])
        msg = "Input should be a valid integer, unable to parse string as an integer"
        return _fail(errors, "int_parsing", loc, msg, value)
    return _fail(errors, "int_type", loc, "Input should be a valid integer", value)


def _to_float(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
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
        return _fail(errors, "float_parsing", loc, msg, value)
    return _fail(errors, "float_type", loc, "Input should be a valid number", value)


def _to_bool(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
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
            return _fail(errors, "bool_parsing", loc, msg, value)
        if isinstance(value, str):
            msg = "Input should be a valid boolean, unable to interpret input"
            return _fail(errors, "bool_parsing", loc, msg, value)
    return _fail(errors, "bool_type", loc, "Input should be a valid boolean", value)


def _fail(
    errors: Errors | None, kind: str, loc: Loc, msg: str, value: object, **ctx: object
) -> _Fail:
    if errors is not None:
        errors.add(kind, loc, msg, value, **ctx)
    return FAIL


def _bounded(result: object, t: mi.IntType, loc: Loc, errors: Errors | None, raw: object) -> object:
    if not isinstance(result, int):
        return result
    if t.ge is not None and result < t.ge:
        msg = f"Input should be greater than or equal to {t.ge}"
        return _fail(errors, "greater_than_equal", loc, msg, raw, ge=t.ge)
    if t.le is not None and result > t.le:
        msg = f"Input should be less than or equal to {t.le}"
        return _fail(errors, "less_than_equal", loc, msg, raw, le=t.le)
    return result


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _to_str(value: object, t: mi.StrType, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if not isinstance(value, str):
        return _fail(errors, "string_type", loc, "Input should be a valid string", value)
    if t.min_length is not None and len(value) < t.min_length:
        msg = f"String should have at least {_plural(t.min_length, 'character')}"
        return _fail(errors, "string_too_short", loc, msg, value, min_length=t.min_length)
    if t.max_length is not None and len(value) > t.max_length:
        msg = f"String should have at most {_plural(t.max_length, 'character')}"
        return _fail(errors, "string_too_long", loc, msg, value, max_length=t.max_length)
    return value


def _to_literal(
    value: object, t: mi.LiteralType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if value in t.values and type(value) is str:
        return value
    declared = _LITERAL_ORDER.get(tuple(sorted(t.values, key=str)), t.values)
    quoted = [repr(v) for v in declared]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    msg = f"Input should be {expected}"
    return _fail(errors, "literal_error", loc, msg, value, expected=expected)


def _to_list(
    value: object, t: mi.ListType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if type(value) is not list:
        return _fail(errors, "list_type", loc, "Input should be a valid list", value)
    out: list[object] = []
    failed = False
    item_type = t.item_type
    rule = _RULES[type(item_type)]
    for index, item in enumerate(value):
        result = rule(item, item_type, loc, None, strict)
        if result is FAIL:
            if errors is None:
                return FAIL
            if rule in _LEAF_RULES and len(errors.kept) == KEPT_ERRORS:
                errors.count += 1
            else:
                rule(item, item_type, (*loc, index), errors, strict)
            failed = True
        out.append(result)
    if failed:
        return FAIL
    if t.max_length is not None and len(out) > t.max_length:
        msg = (
            f"List should have at most {_plural(t.max_length, 'item')} after validation, "
            f"not {len(out)}"
        )
        ctx = {"field_type": "List", "max_length": t.max_length, "actual_length": len(out)}
        return _fail(errors, "too_long", loc, msg, value, **ctx)
    return out


def _to_dict(
    value: object, t: mi.DictType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if type(value) is not dict:
        return _fail(errors, "dict_type", loc, "Input should be a valid dictionary", value)
    out: dict[object, object] = {}
    failed = False
    value_type = t.value_type
    rule = _RULES[type(value_type)]
    for key, item in value.items():
        result = rule(item, value_type, loc, None, strict)
        if result is FAIL:
            if errors is None:
                return FAIL
            rule(item, value_type, (*loc, key), errors, strict)
            failed = True
        out[key] = result
    return FAIL if failed else out


def validate_struct(
    value: object, t: mi.StructType, loc: Loc, errors: Errors | None, strict: bool = False
) -> object:
    """The struct `t` from an object's fields, or FAIL; unknown keys are ignored."""
    if type(value) is not dict:
        if errors is not None:
            NOT_AN_OBJECT.get(t.cls, _model_attributes_type)(value, loc, errors)
        return FAIL
    fields: dict[str, object] = {}
    failed = False
    for field in t.fields:
        if field.encode_name not in value:
            if field.required:
                if errors is None:
                    return FAIL
                errors.add("missing", (*loc, field.encode_name), "Field required", value)
                failed = True
            continue
        union = UNION_FIELDS.get((t.cls, field.name))
        field_type = union.type if union is not None else field.type
        item = value[field.encode_name]
        hook = FIELD_HOOKS.get((t.cls, field.name))
        if hook is not None:
            item = hook(item)
        result = validate(item, field_type, (*loc, field.encode_name), errors, strict)
        if result is FAIL:
            if errors is None:
                return FAIL
            failed = True
        fields[field.name] = result
    if failed:
        return FAIL
    result = t.cls(**fields)
    check = STRUCT_CHECKS.get(t.cls)
    if check is not None:
        check(result)
    return result


def _to_union(
    value: object, t: mi.UnionType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    members = [m for m in t.types if not isinstance(m, mi.NoneType)]
    if value is None and len(members) < len(t.types):
        return None
    if len(members) == 1:
        return validate(value, members[0], loc, errors, strict)
    declared = _STRICT_UNIONS.get(id(t))
    if declared is not None:
        result = declared.strict(value)
        if result is not FAIL:
            return result
    else:
        for member in members:
            result = validate(value, member, loc, None, True)
            if result is not FAIL:
                return result
    if strict:
        return FAIL
    collected = Errors()
    for member in members:
        attempt = Errors()
        result = validate(value, member, loc, attempt, False)
        if result is not FAIL:
            return result
        collected.merge(attempt)
    if errors is not None:
        errors.merge(collected)
    return FAIL


def _any_rule(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    return value


def _none_rule(value: object, t: Any, loc: Loc, errors: Errors | None, strict: bool) -> object:
    if value is None:
        return None
    return _fail(errors, "none_required", loc, "Input should be None", value)


Rule = Callable[[Any, Any, Loc, "Errors | None", bool], object]
_RULES: Final[dict[type, Rule]] = {
    mi.AnyType: _any_rule,
    mi.UnionType: _to_union,
    mi.IntType: _to_int,
    mi.FloatType: _to_float,
    mi.BoolType: _to_bool,
    mi.StrType: _to_str,
    mi.LiteralType: _to_literal,
    mi.ListType: _to_list,
    mi.DictType: _to_dict,
    mi.StructType: validate_struct,
    mi.NoneType: _none_rule,
}


# Rules whose value fails with exactly one error.
_LEAF_RULES: Final = frozenset({_to_int, _to_float, _to_bool, _to_str, _to_literal})


def validate(
    value: object, t: mi.Type, loc: Loc, errors: Errors | None, strict: bool = False
) -> object:
    """`value` as type `t` by pydantic's lax rules (strict ones if `strict`), or FAIL.

    Errors go to `errors`; without a sink the first failure ends the validation.
    """
    return _RULES[type(t)](value, t, loc, errors, strict)


def _strict(raw: dict[str, Any], t: mi.StructType) -> Any:
    try:
        result = msgspec.convert(raw, t.cls, strict=True)
    except (msgspec.ValidationError, UnicodeEncodeError):
        return FAIL
    for field in t.fields:
        if field.encode_name not in raw:
            continue
        value = raw[field.encode_name]
        hook = FIELD_HOOKS.get((t.cls, field.name))
        if hook is not None:
            setattr(result, field.name, hook(value))
        union = UNION_FIELDS.get((t.cls, field.name))
        if union is not None:
            value = union.strict(value)
            if value is FAIL:
                return FAIL
            setattr(result, field.name, value)
        value = getattr(result, field.name)
        check = STRUCT_CHECKS.get(type(value))
        if check is not None:
            check(value)
    return result


def convert(raw: dict[str, Any], t: mi.StructType) -> Any:
    """The request struct `t` from a parsed body: msgspec's strict path, else pydantic's lax one."""
    result = _strict(raw, t)
    if result is not FAIL:
        return result
    errors = Errors()
    result = validate_struct(raw, t, ("body",), errors)
    if result is FAIL:
        raise request_validation_error(errors)
    return result
