"""The single validation pass over the merged layers, and the rules across keys.

Every problem is reported, not only the first: a key that is refused is left at its default
(or out of the rules that need it) and the pass goes on, so one run of `engined serve` names
every bad key of a configuration, each with the layer that set it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engined.config.api_keys import key_problem, read_key_file
from engined.config.endpoints import WILDCARD_HOSTS, parse_endpoint
from engined.config.fields import (
    DAEMON_FIELD_TYPES,
    ENGINE_FIELD_TYPES,
    KEYS,
    table_struct,
    unconstrained,
)
from engined.config.lora_modules import parse_lora_modules
from engined.config.schema import ConfigError, DaemonConfig
from engined.core.args import EngineArgs, EngineType
from engined.core.assembly import check_vllm_only, runs_vllm_pool
from engined.core.errors import InvalidArgsError

# The core keeps Dynamo mocker's text for a range it refuses (the seed twins assert it); the
# key the config line starts with already says what was validated.
_CORE_PREFIX = "Failed to validate MockEngineArgs: "


@dataclass(slots=True)
class Layers:
    """The merged raw settings, which layer set each key (for messages), and the problems
    found so far."""

    daemon: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    problems: list[ConfigError] = field(default_factory=list)

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

    def report(self, key: str, problem: str) -> None:
        self.problems.append(self.error(key, problem))

    def refused(self, key: str) -> bool:
        return any(p.key == key for p in self.problems)

    def check(self) -> None:
        """Raise the problems found so far, all in one ConfigError."""
        if self.problems:
            raise ConfigError.of(self.problems)


def validate(layers: Layers) -> DaemonConfig:
    """The single validation pass: daemon keys, engine keys, then rules across them.

    Raises:
        ConfigError: every problem found, a line each (`ConfigError.problems`).
    """
    values = {}
    for key, value in layers.daemon.items():
        try:
            values[key] = _daemon_value(layers, key, value)
        except ConfigError as error:
            layers.problems.append(error)
    config = DaemonConfig(**values)
    _check_engine_types(layers)
    engine = _engine_args(layers)
    try:
        # Offload tiers are built per core; refuse an impossible shape before any is.
        check_vllm_only(engine, paged=runs_vllm_pool(engine))
    except InvalidArgsError as error:
        layers.report(_engine_key(error), _user_text(error))
    if engine.engine_type is EngineType.SGLANG:
        # The engine refuses it; refusing here makes it a bad setting (exit 2), not a crash.
        layers.report(
            "engine.engine_type",
            "sglang is not supported: engined simulates the vllm and trtllm schedulers only",
        )
    config = msgspec.structs.replace(config, engine=engine)
    if config.realtime_priority and engine.speedup_ratio == 0:
        layers.report(
            "realtime_priority",
            "needs engine.speedup_ratio > 0: an unpaced daemon never sleeps, and at real-time "
            "priority it would hold its cores against every other process",
        )
    if not math.isfinite(config.drain_timeout):
        layers.report("drain_timeout", f"must be finite, got {config.drain_timeout}")
    if config.kv_events_endpoint is None and config.kv_replay_endpoint is not None:
        layers.report(
            "kv_replay_endpoint",
            'replays KV events, but kv_events_endpoint = "" publishes none; unset one of them',
        )
    _check_endpoints(config, layers)
    _check_access(config, layers)
    if config.curve_secret_key_file and config.api_port is not None:
        layers.report(
            "api_port",
            'the OpenAI API servers cannot yet connect to a daemon under CURVE; set api_port = "" '
            '(--port "") and put the API behind a gateway, or run without CURVE',
        )
    if config.model and "model_name" not in layers.sources:
        # vLLM serves MODEL under its own name unless --served-model-name says otherwise.
        config = msgspec.structs.replace(config, model_name=config.model)
    try:
        parse_lora_modules(config.lora_modules)
    except ValueError as error:
        layers.report("lora_modules", str(error))
    config = _with_api_keys(config, layers)
    layers.check()
    return config


def _engine_args(layers: Layers) -> EngineArgs:
    """The engine keys as `EngineArgs`. The core stops at the first rule a mapping breaks, so
    each key it refuses is reported, dropped (back to its default) and the rest tried again;
    keys already refused by type are left out from the start."""
    values: dict[str, Any] = {}
    for name, value in layers.engine.items():
        if layers.refused(f"engine.{name}"):
            continue
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if not layers.refused(f"engine.{name}.{k}")}
        values[name] = value
    for _attempt in range(len(values) + 1):
        try:
            return EngineArgs.from_mapping(values)
        except InvalidArgsError as error:
            layers.report(_engine_key(error), _user_text(error))
            if not _drop(values, error.key):
                break
    return EngineArgs.from_mapping({})


def _drop(values: dict[str, Any], key: str | None) -> bool:
    """Remove engine `key` (`block_size`, `sglang.page_size`) from `values`; False if absent."""
    if key is None:
        return False
    table, _, sub = key.partition(".")
    if not sub:
        return values.pop(key, _ABSENT) is not _ABSENT
    inner = values.get(table)
    if not isinstance(inner, dict) or sub not in inner:
        return False
    values[table] = {name: value for name, value in inner.items() if name != sub}
    return True


_ABSENT = object()


def _user_text(error: InvalidArgsError) -> str:
    return str(error).removeprefix(_CORE_PREFIX)


def _with_api_keys(config: DaemonConfig, layers: Layers) -> DaemonConfig:
    """`config` with the keys of `api_key_file` in `api_key`, every key checked.

    The file is read here, once, so that a key file the daemon could not use is refused like
    any bad setting, before a socket is bound.
    """
    if config.api_key_file is not None:
        if config.api_key:
            layers.report(
                "api_key_file",
                f"cannot be set with api_key (from {layers.sources['api_key']}); "
                "give the keys one way",
            )
            return config
        try:
            keys = read_key_file(config.api_key_file)
        except ValueError as error:
            layers.report("api_key_file", str(error))
            return config
        config = msgspec.structs.replace(config, api_key=keys)
    keys = config.api_key or ()
    for number, key in enumerate(keys, 1):
        problem = key_problem(key)
        if problem is not None:
            layers.report("api_key", f"key {number} of {len(keys)} {problem}")
    if config.api_key_metrics and not keys:
        layers.report(
            "api_key_metrics", "needs a key to require: api_key, api_key_file or VLLM_API_KEY"
        )
    return config


def _check_access(config: DaemonConfig, layers: Layers) -> None:
    """The operator endpoint is ipc (the role rests on the kernel's word about the peer's
    uid); CURVE needs its client keys too. Key files are read at start-up."""
    operator = config.operator_endpoint
    if operator not in ("", "auto") and not operator.startswith("ipc://"):
        layers.report(
            "operator_endpoint",
            f'must be "auto", "" or an ipc:// endpoint, got {operator!r}: operators are '
            "known by the uid the kernel reports for an ipc peer",
        )
    if operator.startswith("ipc://"):
        try:
            parse_endpoint(operator)
        except ValueError as error:
            layers.report("operator_endpoint", str(error))
    if bool(config.curve_secret_key_file) != bool(config.curve_authorized_keys_file):
        missing = (
            "curve_authorized_keys_file"
            if config.curve_secret_key_file
            else "curve_secret_key_file"
        )
        layers.report(missing, "CURVE needs both curve_secret_key_file and its client keys")


def _daemon_value(layers: Layers, key: str, value: Any) -> Any:
    """`value` converted to the type of daemon field `key`, or the ConfigError naming it.

    Each field is converted on its own, so the key is known without reading it back out of
    msgspec's message. The type is tried before its bounds: a value of the right type that a
    bound refuses gets the value appended, which msgspec's bound messages leave out.
    """
    shape = KEYS[key]
    if shape.choices and isinstance(value, str):
        # Closed sets of names compare without case (`INFO`), as EngineArgs does for its enums.
        value = value.lower()
        if value not in shape.choices:
            problem = _conversion_problem(value, DAEMON_FIELD_TYPES[key])
            raise layers.error(key, f"{problem}; expected one of {', '.join(shape.choices)}")
    problem = _conversion_problem(value, unconstrained(DAEMON_FIELD_TYPES[key]))
    if problem is not None:
        raise layers.error(key, problem)
    try:
        return msgspec.convert(value, DAEMON_FIELD_TYPES[key])
    except msgspec.ValidationError as error:
        raise layers.error(key, f"{error}, got {value!r}") from None


def _check_engine_types(layers: Layers) -> None:
    """Refuse an engine value of the wrong type, or an unknown key of a sub-table, by name.

    `EngineArgs.from_mapping` would refuse them too, but in one message for the whole
    mapping; checking each field against its type here names the key from the structure.
    Left to `from_mapping`: nulls and enum names (its messages are upstream's) and the
    legacy keys it maps.
    """
    for name, value in layers.engine.items():
        annotation = ENGINE_FIELD_TYPES.get(name)
        key = f"engine.{name}"
        shape = KEYS.get(key)
        if (
            annotation is None
            or value is None
            or (shape and shape.choices and isinstance(value, str))
        ):
            continue
        table = table_struct(annotation)
        if table is not None and isinstance(value, dict):
            _check_table(layers, name, table, value)
            continue
        problem = _conversion_problem(value, annotation)
        if problem is not None:
            layers.report(key, f"{problem} - at `$.{name}`")


def _check_table(
    layers: Layers, name: str, table: type[msgspec.Struct], values: Mapping[str, Any]
) -> None:
    """An engine sub-table (`[engine.sglang]`): unknown keys by name, then each value's type."""
    fields = {info.name: info.type for info in msgspec.structs.fields(table)}
    for sub_name, value in values.items():
        key = f"engine.{name}.{sub_name}"
        if sub_name not in fields:
            layers.report(key, f"Object contains unknown field `{sub_name}` - at `$.{name}`")
            continue
        problem = _conversion_problem(value, fields[sub_name])
        if problem is not None:
            layers.report(key, f"{problem} - at `$.{name}.{sub_name}`")


def _conversion_problem(value: Any, annotation: Any) -> str | None:
    """msgspec's reason `value` is not of type `annotation`, or None when it is."""
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError as error:
        return str(error)
    return None


def _engine_key(error: InvalidArgsError) -> str:
    """The dotted config key of a core error: its `key` (`engine.sglang.page_size`).

    Every refusal of `EngineArgs` and `OffloadConfig` names its field. The bare `engine`
    table stands in only for an error raised without one (none of those is reached here
    today), so that such an error still reports rather than crashes.
    """
    return "engine" if error.key is None else f"engine.{error.key}"


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
            layers.report(key, str(error))
            continue
        if base.port + ranks - 1 > 65535:
            layers.report(
                key,
                f"ranks 0..{ranks - 1} need ports {base.port}..{base.port + ranks - 1}, "
                f"beyond 65535 (engine.dp_size = {dp_size})",
            )
            continue
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
                layers.report(key, f"{endpoint} ({owner}) is also used by {clash}")
                break
            claimed[(host, endpoint.port)] = owner
            if endpoint.scheme == "tcp":
                tcp_ports.setdefault(endpoint.port, []).append((host, owner))
