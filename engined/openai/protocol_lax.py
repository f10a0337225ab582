"""Pydantic's lax validation, as vLLM 0.33's request models run it.

Decoding tries msgspec's strict conversion first; a body it refuses comes here, where every
field is validated the way pydantic 2 does in Python mode (what FastAPI runs on the parsed
JSON): `"12"`, `12.0` and `true` are integers, `"yes"` and `1` are booleans, `"1e3"` is a
number, unions try each member strictly and then laxly and report every member's errors.
What fails is collected as pydantic's error dicts and reported as vLLM reports them
(`errors.request_validation_error`).

The types come from `msgspec.inspect` of the request structs, so a field is declared once.
The rules of single values (numbers, booleans, strings, literals, None) are in
`engined.openai.protocol_lax_scalars`; this module walks structs, lists, dicts and unions with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from engined.openai.api_errors import KEPT_ERRORS, Errors, Loc, request_validation_error

# Re-exported: the request models register their literals and test for FAIL through here.
from engined.openai.protocol_lax_scalars import FAIL as FAIL
from engined.openai.protocol_lax_scalars import (
    fail,
    none_rule,
    plural,
    to_bool,
    to_float,
    to_int,
    to_literal,
    to_str,
)
from engined.openai.protocol_lax_scalars import register_literals as register_literals

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


def _to_list(
    value: object, t: mi.ListType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if type(value) is not list:
        return fail(errors, "list_type", loc, "Input should be a valid list", value)
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
            f"List should have at most {plural(t.max_length, 'item')} after validation, "
            f"not {len(out)}"
        )
        ctx = {"field_type": "List", "max_length": t.max_length, "actual_length": len(out)}
        return fail(errors, "too_long", loc, msg, value, **ctx)
    return out


def _to_dict(
    value: object, t: mi.DictType, loc: Loc, errors: Errors | None, strict: bool
) -> object:
    if type(value) is not dict:
        return fail(errors, "dict_type", loc, "Input should be a valid dictionary", value)
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


Rule = Callable[[Any, Any, Loc, "Errors | None", bool], object]
_RULES: Final[dict[type, Rule]] = {
    mi.AnyType: _any_rule,
    mi.UnionType: _to_union,
    mi.IntType: to_int,
    mi.FloatType: to_float,
    mi.BoolType: to_bool,
    mi.StrType: to_str,
    mi.LiteralType: to_literal,
    mi.ListType: _to_list,
    mi.DictType: _to_dict,
    mi.StructType: validate_struct,
    mi.NoneType: none_rule,
}


# Rules whose value fails with exactly one error.
_LEAF_RULES: Final = frozenset({to_int, to_float, to_bool, to_str, to_literal})


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
