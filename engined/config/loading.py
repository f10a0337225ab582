"""Layered loading: defaults < TOML file < `ENGINED_*` environment < flags.

Each layer only collects raw values (text parsed to the key's shape); judging them is left
to the one validation pass, so a value is checked once, in its final form. `VLLM_API_KEY` is
vLLM's fallback for `--api-key`, so it counts only when no layer gives a key.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from engined.config.fields import (
    DAEMON_TABLE_KEYS,
    ENGINE_TABLE_KEYS,
    ENV_ALLOWLIST,
    ENV_KEYS,
    ENV_PREFIX,
    KEYS,
)
from engined.config.flags import FLAG_OF_KEY
from engined.config.schema import ConfigError, DaemonConfig
from engined.config.validation import Layers, validate

VLLM_API_KEY = "VLLM_API_KEY"


def load_config(
    *,
    config_path: str | Path | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any],
    given: set[str] | None = None,
) -> DaemonConfig:
    """Layer defaults < TOML file < `ENGINED_*` environment < flags, then validate once.

    Args:
        config_path: TOML file with top-level daemon keys and an `[engine]` table of `EngineArgs`
            keys (a Dynamo mocker JSON's keys load unchanged there), or None for no file.
        env: the process environment; every `ENGINED_*` variable must name a setting
            (`env_name`) unless it is in `ENV_ALLOWLIST`, so typos surface.
        flags: only the flags the user gave, by dotted config key (`engine.block_size`,
            `drain_timeout`). String values are parsed like environment values (the CLI passes
            text); other values are taken as they are.
        given: filled, when passed, with the keys some layer set (where vLLM's defaults
            depend on whether a setting was given at all).

    Returns:
        The validated configuration, with normalised engine arguments.

    Raises:
        ConfigError: every problem found, a line each naming the key (or variable) and the
            layer that set it; an unreadable or malformed file alone, as nothing else can be
            judged without it.
    """
    layers = Layers()
    if config_path is not None:
        path = Path(config_path)
        _apply_toml(layers, _read_toml(path), source=str(path))
    _apply_env(layers, env)
    _apply_flags(layers, flags)
    _apply_vllm_api_key(layers, env)
    if given is not None:
        given.update(layers.sources)
    return validate(layers)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as error:
        raise ConfigError(f"config file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path}: {error}") from None


def _apply_toml(layers: Layers, data: Mapping[str, Any], *, source: str) -> None:
    for name, value in data.items():
        if name == "engine":
            if not isinstance(value, dict):
                layers.report("engine", "must be a table ([engine])")
                continue
            for engine_name, engine_value in value.items():
                key = f"engine.{engine_name}"
                if engine_name not in ENGINE_TABLE_KEYS:
                    hint = _did_you_mean(engine_name, ENGINE_TABLE_KEYS)
                    layers.problems.append(
                        ConfigError(f"{key}: unknown key in {source}{hint}", key=key)
                    )
                    continue
                _collect(layers, key, partial(_empty_is_none, key, engine_value, source), source)
        elif name in DAEMON_TABLE_KEYS:
            _collect(layers, name, partial(_empty_is_none, name, value, source), source)
        elif name in ENGINE_TABLE_KEYS:
            layers.problems.append(
                ConfigError(
                    f"{name}: unknown top-level key in {source}; engine keys belong in the "
                    f"[engine] table (engine.{name})",
                    key=name,
                )
            )
        else:
            hint = _did_you_mean(name, DAEMON_TABLE_KEYS | {"engine"})
            layers.problems.append(ConfigError(f"{name}: unknown key in {source}{hint}", key=name))


def _collect(layers: Layers, key: str, value: Callable[[], Any], source: str) -> None:
    """Set `key` to `value()`, or note why its raw value cannot even be read and go on."""
    try:
        layers.set(key, value(), source)
    except ConfigError as error:
        layers.problems.append(error)


def _apply_env(layers: Layers, env: Mapping[str, str]) -> None:
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in ENV_ALLOWLIST:
            continue
        key = ENV_KEYS.get(name)
        if key is None:
            hint = _did_you_mean(name, ENV_KEYS)
            layers.problems.append(ConfigError(f"{name}: unknown environment variable{hint}"))
            continue
        _collect(layers, key, partial(_parse_text, key, env[name], source=name), name)


def _apply_vllm_api_key(layers: Layers, env: Mapping[str, str]) -> None:
    """vLLM reads VLLM_API_KEY only without `--api-key`; here, without any key or key file."""
    text = env.get(VLLM_API_KEY, "")
    if text and not layers.daemon.get("api_key") and layers.daemon.get("api_key_file") is None:
        _collect(
            layers,
            "api_key",
            lambda: _parse_text("api_key", text, source=VLLM_API_KEY),
            VLLM_API_KEY,
        )


def _apply_flags(layers: Layers, flags: Mapping[str, Any]) -> None:
    for key, value in flags.items():
        if key not in KEYS:
            layers.problems.append(
                ConfigError(f"{key}: not a setting a flag can set{_did_you_mean(key, KEYS)}")
            )
            continue
        flag = FLAG_OF_KEY.get(key)
        source = flag.name if flag is not None else key
        if isinstance(value, str):
            _collect(layers, key, partial(_parse_text, key, value, source=source), source)
        else:
            layers.set(key, value, source)


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
# The counts vLLM reads "human-readable" (vllm/utils/argparse_utils.py): `1k` is 1,000, `1K`
# 1,024, `25.6k` 25,600, so that a `vllm serve --max-model-len 32k` line runs unchanged;
# `max_model_len` also takes vLLM's `auto` (or -1): the model's own, engined's unset.
_HUMAN_READABLE = frozenset(
    {
        "engine.max_num_batched_tokens",
        "engine.max_num_scheduled_tokens",
        "engine.max_model_len",
        "max_num_queued_tokens",
    }
)
_AUTO = frozenset({"engine.max_model_len"})
_HUMAN_TEXT = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parse_text(key: str, text: str, *, source: str) -> Any:
    """Turn environment or command-line text into the value `key` takes (range checks later)."""
    shape = KEYS[key]
    if shape.optional and text == "":
        return None
    if shape.kind is str:
        return text
    if shape.kind is tuple:
        return _parse_list(key, text, source=source)
    stripped = text.strip()
    if shape.kind is bool:
        if stripped.lower() in _TRUE:
            return True
        if stripped.lower() in _FALSE:
            return False
        expected = "a boolean (true/false/1/0/yes/no)"
    elif shape.kind is int:
        if key in _AUTO and stripped.lower() in ("auto", "-1"):
            return None
        if _INT_TEXT.fullmatch(stripped):
            return int(stripped)
        if key in _HUMAN_READABLE and (match := _HUMAN_TEXT.fullmatch(stripped)):
            return _human_readable(key, *match.groups(), source=source)
        expected = "an integer"
    else:
        try:
            return float(stripped)
        except ValueError:
            expected = "a number"
    raise ConfigError(f"{key}: expected {expected}, got {text!r} (from {source})", key=key)


def _human_readable(key: str, number: str, suffix: str, *, source: str) -> int:
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ConfigError(
            f"{key}: Decimals are not allowed with binary suffixes like {suffix}. Did you mean "
            f"to use {number}{suffix.lower()} instead? (from {source})",
            key=key,
        )
    return int(number) * _BINARY[suffix]


def _parse_list(key: str, text: str, *, source: str) -> tuple[int, ...] | tuple[str, ...]:
    """The text form of a list: comma-separated integers, as `--nextn-accept-rates` takes
    floats, vLLM's JSON array of strings for the CORS lists (`_JSON_LISTS`), or one string
    item (an API key: opaque, so nothing in it can be a separator). "" is the empty list."""
    if key in _JSON_LISTS:
        return _json_strings(key, text, source=source)
    if KEYS[key].item is str:
        return (text,) if text else ()
    if not text.strip():
        return ()
    parts = [part.strip() for part in text.split(",")]
    if all(_INT_TEXT.fullmatch(part) for part in parts):
        return tuple(int(part) for part in parts)
    raise ConfigError(
        f"{key}: expected comma-separated integers, got {text!r} (from {source})", key=key
    )


# The lists vLLM's command line takes as JSON (`type=json.loads`): its CORS settings.
_JSON_LISTS = frozenset(("allowed_origins", "allowed_methods", "allowed_headers"))


def _json_strings(key: str, text: str, *, source: str) -> tuple[str, ...]:
    """A JSON array of strings, as vLLM's `--allowed-origins '["https://a.example"]'` ("" is
    the empty list, as for every list)."""
    if not text.strip():
        return ()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise ConfigError(
            f"{key}: expected a JSON array of strings, got {shown!r} (from {source})", key=key
        )
    return tuple(value)


def _empty_is_none(key: str, value: Any, source: str) -> Any:
    """TOML has no null: "" stands for None in optional settings (see the module docstring).

    A list setting also takes its command-line text form in TOML, so "" is the empty list
    (and `api_key = "KEY"` one key).
    """
    shape = KEYS.get(key)
    if value == "" and shape is not None and shape.optional:
        return None
    if isinstance(value, str) and shape is not None and shape.kind is tuple:
        return _parse_list(key, value, source=source)
    return value


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
