"""The single validation pass over the merged layers, and the rules across keys."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engined.config.endpoints import WILDCARD_HOSTS, parse_endpoint
from engined.config.fields import ENGINE_TABLE_KEYS, KEYS
from engined.config.schema import ConfigError, DaemonConfig
from engined.core.args import EngineArgs, EngineType
from engined.core.errors import InvalidArgsError
from engined.core.offload.config import OffloadConfig


@dataclass(slots=True)
class Layers:
    """The merged raw settings, and which layer set each key (for messages)."""

    daemon: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, source: str) -> None:
        if key.startswith("engine."):
            self.engine[key.removeprefix("engine.")] = value
        else:
            self.daemon[key] = value
        self.sources[key] = source

    def error(self, key: str, problem: str) -> ConfigError:
        """A ConfigError for `key`, naming the layer that set it (or its table) if not a default."""
        path = key
        while path and path not in self.sources:
            path = path.rpartition(".")[0]
        origin = f" (from {self.sources[path]})" if path else ""
        return ConfigError(f"{key}: {problem}{origin}", key=key)


# msgspec's location suffix and unknown-field wording: "... - at `$.sglang.page_size`".
_MSGSPEC_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MSGSPEC_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def validate(layers: Layers) -> DaemonConfig:
    """The single validation pass: daemon keys, engine keys, then rules across them."""
    daemon = {key: _lowercase_choice(key, value) for key, value in layers.daemon.items()}
    try:
        config = msgspec.convert(daemon, DaemonConfig)
    except msgspec.ValidationError as error:
        key, problem = _msgspec_location(str(error))
        raise layers.error(key or "config", _explained(key, problem, daemon)) from None
    try:
        engine = EngineArgs.from_mapping(layers.engine)
    except InvalidArgsError as error:
        # NOTE: the upstream message is kept verbatim so it can be searched in Dynamo's issues.
        message = str(error)
        raise layers.error(_engine_key(message), message) from None
    try:
        # Offload tiers are built per core; refuse an impossible shape before any is.
        OffloadConfig.from_args(engine)
    except InvalidArgsError as error:
        message = str(error)
        raise layers.error(_engine_key(message), message) from None
    if engine.engine_type is EngineType.SGLANG:
        # VllmCore refuses it; refusing here makes it a bad setting (exit 2), not a crash.
        raise layers.error(
            "engine.engine_type",
            "sglang is not supported: engined simulates the vllm and trtllm schedulers only",
        )
    config = msgspec.structs.replace(config, engine=engine)
    if not math.isfinite(config.drain_timeout):
        raise layers.error("drain_timeout", f"must be finite, got {config.drain_timeout}")
    _check_endpoints(config, layers)
    return config


def _lowercase_choice(key: str, value: Any) -> Any:
    """Closed sets of names compare without case (`INFO`), as EngineArgs does for its enums."""
    shape = KEYS.get(key)
    if shape is not None and shape.choices and isinstance(value, str):
        return value.lower()
    return value


def _explained(key: str | None, problem: str, values: Mapping[str, Any]) -> str:
    """Add what msgspec leaves out: the choices of a closed set, the value a bound refused."""
    if key is None:
        return problem
    shape = KEYS.get(key)
    if shape is not None and shape.choices and problem.startswith("Invalid enum value"):
        return f"{problem}; expected one of {', '.join(shape.choices)}"
    if key in values and "got" not in problem:
        return f"{problem}, got {values[key]!r}"
    return problem


def _msgspec_location(message: str) -> tuple[str | None, str]:
    """Split a msgspec ValidationError into (dotted key or None, problem)."""
    at = _MSGSPEC_AT.search(message)
    path = at["path"] if at else ""
    problem = message[: at.start()] if at else message
    unknown = _MSGSPEC_UNKNOWN.search(problem)
    if unknown is not None:
        path = f"{path}.{unknown['name']}" if path else unknown["name"]
        problem = "unknown key"
    return (path or None), problem


def _engine_field_pattern() -> re.Pattern[str]:
    names = set(ENGINE_TABLE_KEYS)
    for table in ("trtllm", "sglang"):
        names.update(f"{table}.{name}" for name in _table_fields(table))
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w.])(?:{alternatives})(?!\w)")


def _table_fields(table: str) -> Iterator[str]:
    annotation = next(f.type for f in msgspec.structs.fields(EngineArgs) if f.name == table)
    struct = next(a for a in typing.get_args(annotation) if a is not type(None))
    return (f.name for f in msgspec.structs.fields(struct))


_ENGINE_FIELD = _engine_field_pattern()


def _engine_key(message: str) -> str:
    """The engine key an InvalidArgsError is about.

    msgspec messages carry a path; upstream messages name the key in the text, first
    (`block_size must be greater than 0`, `Failed to validate MockEngineArgs: dp_size must be
    >= 1`, `Invalid engine_type 'x'`), so the earliest field name in the text is taken. A rule
    across two keys is reported under the first one it names.
    """
    key, _ = _msgspec_location(message)
    if key is None:
        match = _ENGINE_FIELD.search(message)
        key = match[0] if match else None
    return f"engine.{key}" if key else "engine"


def _check_endpoints(config: DaemonConfig, layers: Layers) -> None:
    """Every endpoint parses, every rank's port exists, and no two bound sockets share one.

    Done here rather than at bind time so the message names the key and the rank, instead of
    a bare "Address already in use" from the second socket.
    """
    dp_size = config.engine.dp_size
    sockets: tuple[tuple[str, str | None, int, bool], ...] = (
        ("control_endpoint", config.control_endpoint, 1, True),
        ("kv_events_endpoint", config.kv_events_endpoint, dp_size, not config.kv_events_connect),
        ("kv_replay_endpoint", config.kv_replay_endpoint, dp_size, True),
        ("fpm_endpoint", config.fpm_endpoint, dp_size, True),
    )
    claimed: dict[tuple[str, int], str] = {}  # (tcp host or ipc path, port) -> owner
    tcp_ports: dict[int, list[tuple[str, str]]] = {}  # port -> [(host, owner)]
    for key, text, ranks, binds in sockets:
        if text is None:
            continue
        try:
            base = parse_endpoint(text)
        except ValueError as error:
            raise layers.error(key, str(error)) from None
        if base.port + ranks - 1 > 65535:
            raise layers.error(
                key,
                f"ranks 0..{ranks - 1} need ports {base.port}..{base.port + ranks - 1}, "
                f"beyond 65535 (engine.dp_size = {dp_size})",
            )
        if not binds:
            continue
        for rank in range(ranks):
            endpoint = base.for_rank(rank)
            owner = f"{key} rank {rank}" if ranks > 1 else key
            host = endpoint.where.lower() if endpoint.scheme == "tcp" else endpoint.where
            clash = claimed.get((host, endpoint.port))
            if clash is None and endpoint.scheme == "tcp":
                clash = next(
                    (
                        other_owner
                        for other_host, other_owner in tcp_ports.get(endpoint.port, [])
                        if host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS
                    ),
                    None,
                )
            if clash is not None:
                raise layers.error(key, f"{endpoint} ({owner}) is also used by {clash}")
            claimed[(host, endpoint.port)] = owner
            if endpoint.scheme == "tcp":
                tcp_ports.setdefault(endpoint.port, []).append((host, owner))
