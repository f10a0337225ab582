"""Daemon configuration: one `DaemonConfig`, loaded in layers and validated once.

Precedence is defaults < TOML file < `ENGINED_*` environment < command-line flags. The layers are
merged into plain dicts first and validated in a single pass at the end, so each value is judged
once, in its final form, and every message starts with the key it is about (`engine.block_size:`)
and names the layer that set it (`(from ENGINED_BLOCK_SIZE)`). A bad setting is refused before
any socket is bound, rather than surfacing later as a bind error or a failing rank.

Each setting is declared once: the fields of `DaemonConfig` and `EngineArgs` give keys, types and
defaults; `FLAGS` gives the command-line spelling and help; environment names derive from keys.

One rule holds in every layer: for an optional setting an empty string means "unset" (`None`).
That is the only way to say `None` in TOML or in the environment, e.g. `fpm_endpoint = ""` turns
forward-pass metrics off and `ENGINED_MAX_NUM_SEQS=` lifts the running-request limit.
"""

from __future__ import annotations

import difflib
import enum
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from engined.core.args import EngineArgs, EngineType
from engined.core.errors import InvalidArgsError
from engined.core.offload.config import OffloadConfig

LogFormat = Literal["auto", "console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
KvEventsFormat = Literal["vllm", "vllm-array"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

ENV_PREFIX = "ENGINED_"
# `ENGINED_*` variables that are not settings and must not be refused as typos. Empty for now;
# add a name here (with its reader) before any code reads another `ENGINED_*` variable.
ENV_ALLOWLIST: frozenset[str] = frozenset()

_DEFAULT_ENGINE = EngineArgs().normalized()


class DaemonConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every daemon setting; the field comments are the configuration reference.

    Build it with `load_config`, which validates across fields (endpoints against `dp_size`).
    `engine` holds normalised `EngineArgs`; the default is already normalised so that
    `DaemonConfig()` equals the configuration loaded from nothing.
    """

    # Served model name, reported in `welcome`.
    model_name: Annotated[str, msgspec.Meta(min_length=1)] = "engined"
    # ROUTER the clients' DEALERs connect to (protocol.md §1).
    control_endpoint: str = "tcp://127.0.0.1:5555"
    # KV events PUB of rank 0; rank r uses `endpoint_for_rank(kv_events_endpoint, r)`.
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    # True: each PUB connects to a central collector instead of binding.
    kv_events_connect: bool = False
    # KV replay ROUTER of rank 0 (rank r as above); None turns replay off.
    kv_replay_endpoint: str | None = None
    # Replay keeps the last this many KV event messages per rank.
    kv_replay_buffer: Annotated[int, msgspec.Meta(ge=1)] = 10000
    # Bytes of replay one replay client may have queued and unread; the rest follows as it reads.
    kv_replay_client_bytes: Annotated[int, msgspec.Meta(ge=1)] = 8 * 1024 * 1024
    # Bytes of KV event batches queued for one slow subscriber, per rank, before it misses some.
    kv_events_buffer_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 * 1024 * 1024
    # First frame of every KV event message.
    kv_events_topic: str = ""
    # "vllm": vLLM >= 0.24 tagged maps; "vllm-array": vLLM 0.22/0.23 positional arrays.
    kv_events_format: KvEventsFormat = "vllm"
    # Forward-pass metrics PUB of rank 0 (rank r as above); None turns FPM off.
    fpm_endpoint: str | None = "tcp://127.0.0.1:20380"
    # FPM `worker_id`; "" means the daemon uses f"{hostname}:{pid}" (resolved at startup).
    worker_id: str = ""
    # Most requests waiting to run per rank before `submit` answers `overloaded`; 0 = no limit.
    # 16 batches of the default max_num_seqs (README "Limits and guarantees" says why).
    max_queued_requests: Annotated[int, msgspec.Meta(ge=0)] = 4096
    # Seconds in-flight requests get to finish at shutdown before they are cancelled.
    drain_timeout: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    # "auto" logs JSON when stderr is not a TTY and console lines when it is.
    log_format: LogFormat = "auto"
    log_level: LogLevel = "info"
    # Port of the HTTP server for Prometheus /metrics and /health; None = no HTTP server.
    http_port: Port | None = None
    # Address the HTTP server listens on; loopback by default, since /metrics is unauthenticated.
    http_host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    # The simulation (engined.core.args); TOML table `[engine]`.
    engine: EngineArgs = _DEFAULT_ENGINE


class ConfigError(Exception):
    """A setting cannot be used. The message starts with the key (or file) it is about.

    Attributes:
        key: dotted config key (`engine.block_size`, `control_endpoint`), or None when the
            problem is not one setting (an unreadable file, an unknown environment variable).
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# --- keys and their types ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Scalar:
    """What a text value (environment, command line) must parse to for one key."""

    kind: type  # bool, int, float, str, or tuple (of ints, comma-separated in text)
    optional: bool  # None allowed, spelled "" in text
    choices: tuple[str, ...]  # closed set of strings (Literal or enum), else ()


def _scalar(annotation: Any) -> _Scalar | None:
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
        return _Scalar(str, optional, tuple(str(a) for a in typing.get_args(annotation)))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _Scalar(str, optional, tuple(str(m.value) for m in annotation))
    if annotation in (bool, int, float, str):
        return _Scalar(annotation, optional, ())
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (int, ...):
        return _Scalar(tuple, optional, ())
    return None


def _scalar_keys(struct: type[msgspec.Struct], prefix: str) -> dict[str, _Scalar]:
    keys: dict[str, _Scalar] = {}
    for info in msgspec.structs.fields(struct):
        shape = _scalar(info.type)
        if shape is not None:
            keys[prefix + info.name] = shape
    return keys


# Every key a flag or an environment variable can set, dotted (`engine.block_size`).
_KEYS: dict[str, _Scalar] = {
    **_scalar_keys(DaemonConfig, ""),
    **_scalar_keys(EngineArgs, "engine."),
}
_DAEMON_TABLE_KEYS = frozenset(f.name for f in msgspec.structs.fields(DaemonConfig)) - {"engine"}
# NOTE: `EngineArgs.from_mapping` also takes these pre-`worker_type` keys of Dynamo mocker JSON;
# refusing them here would break "a mocker config loads unchanged".
_LEGACY_ENGINE_KEYS = frozenset({"is_prefill", "is_decode", "has_perf_model"})
_ENGINE_TABLE_KEYS = (
    frozenset(f.name for f in msgspec.structs.fields(EngineArgs)) | _LEGACY_ENGINE_KEYS
)


def env_name(key: str) -> str:
    """The environment variable of a dotted config key: `engine.block_size` -> ENGINED_BLOCK_SIZE.

    Engine keys drop their table (no engine key shares a name with a daemon key), so the names
    match the flags users already know from vLLM and Dynamo.

    Raises:
        ValueError: `key` is not a setting with an environment variable (unknown, or a table).
    """
    if key not in _KEYS:
        raise ValueError(f"{key} has no environment variable")
    return ENV_PREFIX + key.removeprefix("engine.").upper()


_ENV_KEYS: dict[str, str] = {env_name(key): key for key in _KEYS}
assert len(_ENV_KEYS) == len(_KEYS), "a daemon key and an engine key share an env name"


# --- command-line flags -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flag:
    """One option of `engined serve`: `name` sets the config `key` (dotted for engine keys)."""

    name: str
    key: str
    help: str
    metavar_override: str | None = None

    @property
    def section(self) -> Literal["daemon", "engine"]:
        return "engine" if self.key.startswith("engine.") else "daemon"

    @property
    def dest(self) -> str:
        """A Python identifier for the option (`--block-size` -> `block_size`)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """Booleans are `--x/--no-x` switches rather than options taking a value."""
        return _KEYS[self.key].kind is bool

    @property
    def negation(self) -> str:
        return "--no-" + self.name.removeprefix("--")

    @property
    def metavar(self) -> str:
        if self.metavar_override is not None:
            return self.metavar_override
        shape = _KEYS[self.key]
        if shape.choices:
            return "[" + "|".join(shape.choices) + "]"
        return {bool: "BOOL", int: "INT", float: "FLOAT", tuple: "INT,..."}.get(shape.kind, "TEXT")


_ENDPOINT = "ENDPOINT"
_OFF = ' ("" = off)'

# Spellings follow vLLM and Dynamo's mocker where they have one (`--data-parallel-size`,
# `--nextn`); the rest are the key with dashes.
FLAGS: tuple[Flag, ...] = (
    # NOTE: sglang is an EngineType (mocker configs name it) but no core simulates it.
    Flag(
        "--engine-type",
        "engine.engine_type",
        "Engine whose scheduler is simulated.",
        "[vllm|trtllm]",
    ),
    Flag("--worker-type", "engine.worker_type", "Aggregated, or one side of disaggregation."),
    Flag("--num-gpu-blocks", "engine.num_gpu_blocks", "KV cache blocks per rank."),
    Flag(
        "--block-size",
        "engine.block_size",
        "Tokens per KV block (0 = engine default: vllm 64, trtllm 32, sglang 1).",
    ),
    Flag("--max-num-seqs", "engine.max_num_seqs", 'Running requests per rank ("" = no limit).'),
    Flag(
        "--max-num-batched-tokens",
        "engine.max_num_batched_tokens",
        'Token budget of one pass ("" = no limit).',
    ),
    Flag("--max-model-len", "engine.max_model_len", "Longest prompt + output (vllm only)."),
    Flag(
        "--enable-prefix-caching",
        "engine.enable_prefix_caching",
        "Reuse cached KV blocks of shared prefixes.",
    ),
    Flag(
        "--enable-chunked-prefill",
        "engine.enable_chunked_prefill",
        "Split long prefills across passes.",
    ),
    Flag("--preemption-mode", "engine.preemption_mode", "Which running request is preempted."),
    Flag(
        "--speedup-ratio",
        "engine.speedup_ratio",
        "Wall time = modeled time / ratio; 0 runs as fast as the CPU allows.",
    ),
    Flag("--decode-speedup-ratio", "engine.decode_speedup_ratio", "Extra speedup of decode."),
    Flag("--data-parallel-size", "engine.dp_size", "Data-parallel ranks (one core each)."),
    Flag("--kv-bytes-per-token", "engine.kv_bytes_per_token", "KV size per token, for transfers."),
    Flag(
        "--kv-transfer-bandwidth",
        "engine.kv_transfer_bandwidth",
        "KV transfer bandwidth in GB/s (disaggregated handoff delay).",
    ),
    Flag(
        "--kv-transfer-timing-mode",
        "engine.kv_transfer_timing_mode",
        "Which prompt tokens a handoff transfer is timed for.",
    ),
    Flag("--nextn", "engine.aic_nextn", "MTP draft tokens per step (1..5)."),
    Flag(
        "--nextn-accept-rates",
        "engine.aic_nextn_accept_rates",
        'Accept rate per draft position, comma-separated (e.g. "0.85,0.3").',
    ),
    Flag("--mtp-seed", "engine.aic_mtp_seed", "Seed of MTP acceptance sampling."),
    Flag("--seed", "engine.seed", "Seed of generated output tokens."),
    Flag(
        "--vocab-size",
        "engine.vocab_size",
        'Generated ids are drawn from [0, N), so a tokenizer can decode them ("" = raw u32).',
    ),
    Flag(
        "--excluded-token-ids",
        "engine.excluded_token_ids",
        'Ids never generated (EOS, special tokens), comma-separated (e.g. "0,1,2").',
    ),
    Flag(
        "--prefix-hit-rule",
        "engine.prefix_hit_rule",
        "vllm: a fully cached prompt recomputes its last block; mocker-1.3.0: it computes nothing.",
    ),
    Flag("--perf-model", "engine.perf_model", "Pass timing model."),
    Flag(
        "--fixed-prefill-ms-per-token",
        "engine.fixed_prefill_ms_per_token",
        "Fixed model: prefill cost per token (ms).",
    ),
    Flag(
        "--fixed-pass-overhead-ms",
        "engine.fixed_pass_overhead_ms",
        "Fixed model: cost of every pass (ms).",
    ),
    Flag(
        "--fixed-decode-ms-per-pass",
        "engine.fixed_decode_ms_per_pass",
        "Fixed model: cost of a pass with decodes (ms).",
    ),
    Flag(
        "--handoff-session-timeout-ms",
        "engine.handoff_session_timeout_ms",
        "A held source not released, or a destination not activated, is cancelled after this.",
    ),
    Flag(
        "--num-g2-blocks",
        "engine.num_g2_blocks",
        'Host (G2) KV tier blocks per rank; needs --kv-bytes-per-token ("" = off).',
    ),
    Flag(
        "--num-g3-blocks",
        "engine.num_g3_blocks",
        'Disk (G3) KV tier blocks, staged through G2 ("" = off).',
    ),
    Flag("--offload-batch-size", "engine.offload_batch_size", "Blocks per G1->G2 transfer."),
    Flag("--bandwidth-g1-to-g2-gbps", "engine.bandwidth_g1_to_g2_gbps", "GPU->host GB/s."),
    Flag("--bandwidth-g2-to-g1-gbps", "engine.bandwidth_g2_to_g1_gbps", "Host->GPU GB/s."),
    Flag("--bandwidth-g2-to-g3-gbps", "engine.bandwidth_g2_to_g3_gbps", "Host->disk GB/s."),
    Flag("--bandwidth-g3-to-g2-gbps", "engine.bandwidth_g3_to_g2_gbps", "Disk->host GB/s."),
    Flag("--model-name", "model_name", "Served model name."),
    Flag("--control-endpoint", "control_endpoint", "Control ROUTER.", _ENDPOINT),
    Flag(
        "--kv-events-endpoint",
        "kv_events_endpoint",
        "KV events PUB of rank 0 (rank r: port + r, or ipc path-r).",
        _ENDPOINT,
    ),
    Flag(
        "--kv-events-connect",
        "kv_events_connect",
        "KV event PUBs connect to a collector instead of binding.",
    ),
    Flag(
        "--kv-replay-endpoint",
        "kv_replay_endpoint",
        "KV replay ROUTER of rank 0" + _OFF + ".",
        _ENDPOINT,
    ),
    Flag("--kv-replay-buffer", "kv_replay_buffer", "KV event messages kept for replay, per rank."),
    Flag(
        "--kv-replay-client-bytes",
        "kv_replay_client_bytes",
        "Replay bytes one client may have unread; a client that stops reading is dropped.",
    ),
    Flag(
        "--kv-events-buffer-bytes",
        "kv_events_buffer_bytes",
        "KV event bytes queued per slow subscriber, per rank, before it misses batches.",
    ),
    Flag("--kv-events-topic", "kv_events_topic", "Topic frame of KV event messages."),
    Flag("--kv-events-format", "kv_events_format", "vllm: 0.24+ maps; vllm-array: 0.22/0.23."),
    Flag(
        "--fpm-endpoint",
        "fpm_endpoint",
        "Forward-pass metrics PUB of rank 0" + _OFF + ".",
        _ENDPOINT,
    ),
    Flag("--worker-id", "worker_id", 'FPM worker_id ("" = hostname:pid).'),
    Flag(
        "--max-queued-requests",
        "max_queued_requests",
        "Waiting requests per rank before `overloaded` (0 = no limit).",
    ),
    Flag("--drain-timeout", "drain_timeout", "Seconds to finish in-flight requests at shutdown."),
    Flag("--log-format", "log_format", "auto: json unless stderr is a TTY."),
    Flag("--log-level", "log_level", "Lowest level logged."),
    Flag("--http-port", "http_port", "Port for /metrics and /health" + _OFF + "."),
    Flag("--http-host", "http_host", "Address the /metrics and /health server listens on."),
)
_FLAG_OF_KEY: dict[str, Flag] = {flag.key: flag for flag in FLAGS}
assert len(_FLAG_OF_KEY) == len(FLAGS), "two flags set the same key"
assert all(flag.key in _KEYS for flag in FLAGS), "a flag names no scalar key"


# --- endpoints --------------------------------------------------------------------------------


_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]"})
_PORT_TEXT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True, slots=True)
class _Endpoint:
    scheme: Literal["tcp", "ipc"]
    where: str  # tcp: host, IPv6 in brackets; ipc: path
    port: int  # 0 for ipc

    def for_rank(self, rank: int) -> _Endpoint:
        if self.scheme == "ipc":
            return self if rank == 0 else _Endpoint("ipc", f"{self.where}-{rank}", 0)
        return _Endpoint("tcp", self.where, self.port + rank)

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.where}"
        return f"tcp://{self.where}:{self.port}"


def _parse_endpoint(endpoint: str) -> _Endpoint:
    """Split an endpoint; ValueError names what is wrong with it."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if not path:
            raise ValueError(f"{endpoint!r} has no path, expected ipc://PATH")
        return _Endpoint("ipc", path, 0)
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} must start with tcp:// or ipc://")
    host, colon, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    if not colon or not host:
        raise ValueError(f"{endpoint!r} must be tcp://HOST:PORT")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{endpoint!r} has an unterminated IPv6 address")
    elif ":" in host:
        raise ValueError(f"{endpoint!r}: write IPv6 hosts in brackets, e.g. tcp://[::1]:5557")
    if _PORT_TEXT.fullmatch(port_text) is None or not 1 <= int(port_text) <= 65535:
        # NOTE: this also refuses `*` (ephemeral port): per-rank ports are offsets of a known one.
        raise ValueError(f"{endpoint!r} port must be a number in 1..65535, got {port_text!r}")
    return _Endpoint("tcp", host, int(port_text))


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` uses for a per-rank socket (KV events, replay, FPM).

    `tcp://host:port` -> port + rank (IPv6 `tcp://[::1]:5557` too); `ipc://path` -> the path
    itself for rank 0 and `path-{rank}` otherwise, so a dp_size 1 daemon uses the endpoint as given.

    Raises:
        ConfigError: not a tcp:// or ipc:// endpoint, or the port of `rank` exceeds 65535.
        ValueError: `rank` is negative.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    try:
        base = _parse_endpoint(endpoint)
    except ValueError as error:
        raise ConfigError(f"invalid endpoint {error}") from None
    ranked = base.for_rank(rank)
    if ranked.port > 65535:
        raise ConfigError(f"invalid endpoint {endpoint!r}: port of rank {rank} exceeds 65535")
    return str(ranked)


# --- loading ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Layers:
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


def load_config(
    *,
    config_path: str | Path | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any],
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

    Returns:
        The validated configuration, with normalised engine arguments.

    Raises:
        ConfigError: the first problem found, naming the key (or file, or variable).
    """
    layers = _Layers()
    if config_path is not None:
        path = Path(config_path)
        _apply_toml(layers, _read_toml(path), source=str(path))
    _apply_env(layers, env)
    _apply_flags(layers, flags)
    return _validate(layers)


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


def _apply_toml(layers: _Layers, data: Mapping[str, Any], *, source: str) -> None:
    for name, value in data.items():
        if name == "engine":
            if not isinstance(value, dict):
                raise layers.error("engine", "must be a table ([engine])")
            for engine_name, engine_value in value.items():
                key = f"engine.{engine_name}"
                if engine_name not in _ENGINE_TABLE_KEYS:
                    hint = _did_you_mean(engine_name, _ENGINE_TABLE_KEYS)
                    raise ConfigError(f"{key}: unknown key in {source}{hint}", key=key)
                layers.set(key, _empty_is_none(key, engine_value, source), source)
        elif name in _DAEMON_TABLE_KEYS:
            layers.set(name, _empty_is_none(name, value, source), source)
        elif name in _ENGINE_TABLE_KEYS:
            raise ConfigError(
                f"{name}: unknown top-level key in {source}; engine keys belong in the [engine] "
                f"table (engine.{name})",
                key=name,
            )
        else:
            hint = _did_you_mean(name, _DAEMON_TABLE_KEYS | {"engine"})
            raise ConfigError(f"{name}: unknown key in {source}{hint}", key=name)


def _apply_env(layers: _Layers, env: Mapping[str, str]) -> None:
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in ENV_ALLOWLIST:
            continue
        key = _ENV_KEYS.get(name)
        if key is None:
            hint = _did_you_mean(name, _ENV_KEYS)
            raise ConfigError(f"{name}: unknown environment variable{hint}")
        layers.set(key, _parse_text(key, env[name], source=name), name)


def _apply_flags(layers: _Layers, flags: Mapping[str, Any]) -> None:
    for key, value in flags.items():
        if key not in _KEYS:
            raise ConfigError(f"{key}: not a setting a flag can set{_did_you_mean(key, _KEYS)}")
        flag = _FLAG_OF_KEY.get(key)
        source = flag.name if flag is not None else key
        if isinstance(value, str):
            value = _parse_text(key, value, source=source)
        layers.set(key, value, source)


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def _parse_text(key: str, text: str, *, source: str) -> Any:
    """Turn environment or command-line text into the value `key` takes (range checks later)."""
    shape = _KEYS[key]
    if shape.optional and text == "":
        return None
    if shape.kind is str:
        return text
    if shape.kind is tuple:
        return _parse_int_list(key, text, source=source)
    stripped = text.strip()
    if shape.kind is bool:
        if stripped.lower() in _TRUE:
            return True
        if stripped.lower() in _FALSE:
            return False
        expected = "a boolean (true/false/1/0/yes/no)"
    elif shape.kind is int:
        if _INT_TEXT.fullmatch(stripped):
            return int(stripped)
        expected = "an integer"
    else:
        try:
            return float(stripped)
        except ValueError:
            expected = "a number"
    raise ConfigError(f"{key}: expected {expected}, got {text!r} (from {source})", key=key)


def _parse_int_list(key: str, text: str, *, source: str) -> tuple[int, ...]:
    """Comma-separated integers, as `--nextn-accept-rates` takes floats; "" is the empty list."""
    if not text.strip():
        return ()
    parts = [part.strip() for part in text.split(",")]
    if all(_INT_TEXT.fullmatch(part) for part in parts):
        return tuple(int(part) for part in parts)
    raise ConfigError(
        f"{key}: expected comma-separated integers, got {text!r} (from {source})", key=key
    )


def _empty_is_none(key: str, value: Any, source: str) -> Any:
    """TOML has no null: "" stands for None in optional settings (see the module docstring).

    A list setting also takes its command-line text form in TOML, so "" is the empty list.
    """
    shape = _KEYS.get(key)
    if value == "" and shape is not None and shape.optional:
        return None
    if isinstance(value, str) and shape is not None and shape.kind is tuple:
        return _parse_int_list(key, value, source=source)
    return value


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# --- validation -------------------------------------------------------------------------------


# msgspec's location suffix and unknown-field wording: "... - at `$.sglang.page_size`".
_MSGSPEC_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MSGSPEC_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def _validate(layers: _Layers) -> DaemonConfig:
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
    shape = _KEYS.get(key)
    if shape is not None and shape.choices and isinstance(value, str):
        return value.lower()
    return value


def _explained(key: str | None, problem: str, values: Mapping[str, Any]) -> str:
    """Add what msgspec leaves out: the choices of a closed set, the value a bound refused."""
    if key is None:
        return problem
    shape = _KEYS.get(key)
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
    names = set(_ENGINE_TABLE_KEYS)
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


def _check_endpoints(config: DaemonConfig, layers: _Layers) -> None:
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
            base = _parse_endpoint(text)
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
                        if host in _WILDCARD_HOSTS or other_host in _WILDCARD_HOSTS
                    ),
                    None,
                )
            if clash is not None:
                raise layers.error(key, f"{endpoint} ({owner}) is also used by {clash}")
            claimed[(host, endpoint.port)] = owner
            if endpoint.scheme == "tcp":
                tcp_ports.setdefault(endpoint.port, []).append((host, owner))


# --- printing ---------------------------------------------------------------------------------


def dump_config(config: DaemonConfig) -> str:
    """The effective configuration as TOML that `load_config` reads back to an equal config.

    Daemon keys first, then `[engine]` (sub-tables last, as TOML requires). An unset (None)
    setting whose default is also None becomes a comment (`# kv_replay_endpoint = (unset)`);
    one whose default is not None is written as "" so that reloading does not restore the default.
    """
    lines = ["# engined effective configuration", *_toml_body(config, skip={"engine"})]
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
