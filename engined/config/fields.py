"""Reflection over the struct fields: what text each key parses to, and its env name.

Flags and environment variables carry text; these shapes, read off the field types, are
what turns that text into values, so a new field needs no parsing code of its own.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from engined.config.schema import DaemonConfig
from engined.core.args import EngineArgs

ENV_PREFIX = "ENGINED_"
# `ENGINED_*` variables that are not settings and must not be refused as typos; add a name
# here (with its reader) before any code reads another `ENGINED_*` variable. The build reads
# ENGINED_MYPYC and ENGINED_PURE (setup.py), every process ENGINED_PURE
# (engined/core/core_build.py), the test suite ENGINED_EXPECT_COMPILED (tests/conftest.py).
ENV_ALLOWLIST: frozenset[str] = frozenset(
    {"ENGINED_MYPYC", "ENGINED_PURE", "ENGINED_EXPECT_COMPILED"}
)


@dataclass(frozen=True, slots=True)
class Scalar:
    """What a text value (environment, command line) must parse to for one key."""

    kind: type  # bool, int, float, str, or tuple (of `item`s)
    optional: bool  # None allowed, spelled "" in text
    choices: tuple[str, ...]  # closed set of strings (Literal or enum), else ()
    # A tuple's items: ints are comma-separated in text; a str item is the whole text, since
    # no separator can be reserved in opaque values such as API keys.
    item: type | None = None


def scalar(annotation: Any) -> Scalar | None:
    """The scalar shape of a field type, or None for tables (structs, dicts)."""
    optional = False
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            return None
        optional = True
        annotation = members[0]
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return Scalar(str, optional, tuple(str(a) for a in typing.get_args(annotation)))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return Scalar(str, optional, tuple(str(m.value) for m in annotation))
    if annotation in (bool, int, float, str):
        return Scalar(annotation, optional, ())
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation) in (
        (int, ...),
        (str, ...),
    ):
        return Scalar(tuple, optional, (), typing.get_args(annotation)[0])
    return None


def description(annotation: Any) -> str | None:
    """The `msgspec.Meta(description=...)` of a field type, looking inside `X | None`."""
    if typing.get_origin(annotation) is Annotated:
        base, *metadata = typing.get_args(annotation)
        for meta in metadata:
            if isinstance(meta, msgspec.Meta) and meta.description is not None:
                return meta.description
        return description(base)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            text = description(member)
            if text is not None:
                return text
    return None


def scalar_keys(struct: type[msgspec.Struct], prefix: str) -> dict[str, Scalar]:
    keys: dict[str, Scalar] = {}
    for info in msgspec.structs.fields(struct):
        shape = scalar(info.type)
        if shape is not None:
            keys[prefix + info.name] = shape
    return keys


# Every key a flag or an environment variable can set, dotted (`engine.block_size`).
KEYS: dict[str, Scalar] = {
    **scalar_keys(DaemonConfig, ""),
    **scalar_keys(EngineArgs, "engine."),
}
# The help of every described key, by dotted key: the `engined serve --help` texts.
HELP: dict[str, str] = {
    prefix + info.name: text
    for struct, prefix in ((DaemonConfig, ""), (EngineArgs, "engine."))
    for info in msgspec.structs.fields(struct)
    if (text := description(info.type)) is not None
}
DAEMON_TABLE_KEYS = frozenset(f.name for f in msgspec.structs.fields(DaemonConfig)) - {"engine"}
# NOTE: `EngineArgs.from_mapping` also takes these pre-`worker_type` keys of Dynamo mocker JSON;
# refusing them here would break "a mocker config loads unchanged".
LEGACY_ENGINE_KEYS = frozenset({"is_prefill", "is_decode", "has_perf_model"})
ENGINE_TABLE_KEYS = (
    frozenset(f.name for f in msgspec.structs.fields(EngineArgs)) | LEGACY_ENGINE_KEYS
)


# The declared type of every field, by field name (not dotted): what each value is converted to.
DAEMON_FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(DaemonConfig)}
ENGINE_FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(EngineArgs)}


def table_struct(annotation: Any) -> type[msgspec.Struct] | None:
    """The struct of a sub-table field (`SglangArgs | None`), or None for any other type."""
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    structs = [m for m in members if isinstance(m, type) and issubclass(m, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def unconstrained(annotation: Any) -> Any:
    """`annotation` without its `msgspec.Meta` bounds (`Port | None` -> `int | None`)."""
    if typing.get_origin(annotation) is Annotated:
        return unconstrained(typing.get_args(annotation)[0])
    if _is_union(annotation):
        return typing.Union[tuple(unconstrained(m) for m in typing.get_args(annotation))]  # noqa: UP007
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def env_name(key: str) -> str:
    """The environment variable of a dotted config key: `engine.block_size` -> ENGINED_BLOCK_SIZE.

    Engine keys drop their table (no engine key shares a name with a daemon key), so the names
    match the flags users already know from vLLM and Dynamo.

    Raises:
        ValueError: `key` is not a setting with an environment variable (unknown, or a table).
    """
    if key not in KEYS:
        raise ValueError(f"{key} has no environment variable")
    return ENV_PREFIX + key.removeprefix("engine.").upper()


ENV_KEYS: dict[str, str] = {env_name(key): key for key in KEYS}
assert len(ENV_KEYS) == len(KEYS), "a daemon key and an engine key share an env name"
