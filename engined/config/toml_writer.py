"""The effective configuration written back as TOML (`engined serve --print-config`)."""

from __future__ import annotations

import enum
import re
from typing import Any

import msgspec

from engined.config.schema import DaemonConfig


def dump_config(config: DaemonConfig) -> str:
    """The effective configuration as TOML that `load_config` reads back to an equal config.

    Daemon keys first, then `[engine]` (sub-tables last, as TOML requires). An unset (None)
    setting whose default is also None becomes a comment (`# kv_replay_endpoint = (unset)`);
    one whose default is not None is written as "" so that reloading does not restore the default.
    """
    # NOTE: keys read from `api_key_file` stay there; reloading reads the file again.
    skip = {"engine", "api_key"} if config.api_key_file is not None else {"engine"}
    lines = ["# engined effective configuration", *_toml_body(config, skip=skip)]
    lines += ["", "[engine]", *_toml_body(config.engine, skip={"trtllm", "sglang"})]
    for table in ("trtllm", "sglang"):
        value = getattr(config.engine, table)
        if value is None:
            lines += ["", f"# [engine.{table}] (unset)"]
        else:
            lines += ["", f"[engine.{table}]", *_toml_body(value, skip=set())]
    return "\n".join(lines) + "\n"


def _toml_body(struct: msgspec.Struct, *, skip: set[str]) -> list[str]:
    lines = []
    for info in msgspec.structs.fields(struct):
        if info.name in skip:
            continue
        value = getattr(struct, info.name)
        if value is not None:
            lines.append(f"{info.name} = {_toml_value(value)}")
        elif info.default is None or info.default is msgspec.NODEFAULT:
            lines.append(f"# {info.name} = (unset)")
        else:
            lines.append(f'{info.name} = ""  # unset; the default is {_toml_value(info.default)}')
    return lines


_TOML_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _toml_value(value.value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-trip digits; inf and nan are TOML too
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        # NOTE: TOML has no null; a None inside an inline table is left out.
        items = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_char(char: str) -> str:
    escaped = _TOML_ESCAPES.get(char)
    if escaped is not None:
        return escaped
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04X}"
    return char


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)
