"""vLLM's `--kv-events-config` JSON, read onto engined's `kv_events_*` keys.

llm-d's manifests configure the KV event publisher of `vllm serve` with one JSON flag
(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"topic": "kv@$(POD_IP)@MODEL"}`); engined takes the same text so those manifests run
unchanged. Each field lands on the key that means the same thing, so there is still one
setting per fact: `endpoint` on `kv_events_endpoint` (bound when vLLM would bind it, a
wildcard or ipc address, else connected to, `kv_events_connect`, as vLLM's
ZmqEventPublisher decides), `replay_endpoint` on `kv_replay_endpoint`, `topic` on
`kv_events_topic`, `buffer_steps` on `kv_replay_buffer` (one message per pass, so steps and
messages are the same count). `hwm` and `max_queue_size` count messages in vLLM; engined
bounds a slow subscriber in bytes (`kv_events_buffer_bytes`), so they are read and checked
but not used. Events are off, as in vLLM (whose scheduler emits none unless
`enable_kv_cache_events` is true, and whose `null` publisher sends none), when
`enable_kv_cache_events` is false or `publisher` is `"null"`: that lands on
`kv_events_endpoint = ""`, and the other fields, which only shape a publisher, are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from engined.config.schema import ConfigError

FLAG = "--kv-events-config"


class _VllmKvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM 0.33's KVEventsConfig fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _binds(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc addresses and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def kv_events_flags(text: str, *, given: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys `--kv-events-config TEXT` sets, by dotted key.

    Raises:
        ConfigError: not vLLM's JSON, or a key also given by its own flag.
    """
    try:
        config = msgspec.json.decode(text.encode(), type=_VllmKvEventsConfig)
    except msgspec.DecodeError as error:
        raise ConfigError(f"{FLAG}: {error}", key="kv_events_endpoint") from None
    keys: dict[str, Any]
    if not config.enable_kv_cache_events or config.publisher == "null":
        keys = {"kv_events_endpoint": ""}
    else:
        keys = _publishing_keys(config)
    both = sorted(key for key in keys if key in given)
    if both:
        raise ConfigError(
            f"{FLAG}: also given by flag as {', '.join(both)}; set each once",
            key=both[0],
        )
    return keys


def _publishing_keys(config: _VllmKvEventsConfig) -> dict[str, Any]:
    if config.buffer_steps < 1 or config.hwm < 0 or config.max_queue_size < 1:
        raise ConfigError(
            f"{FLAG}: buffer_steps and max_queue_size must be >= 1 and hwm >= 0",
            key="kv_replay_buffer",
        )
    keys: dict[str, Any] = {
        "kv_events_endpoint": config.endpoint,
        "kv_events_connect": not _binds(config.endpoint),
        "kv_events_topic": config.topic,
        "kv_replay_buffer": config.buffer_steps,
    }
    if config.replay_endpoint is not None:
        keys["kv_replay_endpoint"] = config.replay_endpoint
    return keys
