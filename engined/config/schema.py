"""The schema: `DaemonConfig`, whose fields give every daemon key, type and default.

Kept apart from loading so that the daemon and the tools can import the type without the
flag table or the layering machinery.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engined.core.args import EngineArgs

LogFormat = Literal["auto", "console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
KvEventsFormat = Literal["vllm", "vllm-array"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

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
