"""Daemon configuration: one `DaemonConfig`, loaded in layers and validated once.

Precedence is defaults < TOML file < `ENGINED_*` environment < command-line flags. The layers are
merged into plain dicts first and validated in a single pass at the end, so each value is judged
once, in its final form, and every message starts with the key it is about (`engine.block_size:`)
and names the layer that set it (`(from ENGINED_BLOCK_SIZE)`). Every bad key is reported in the
same pass (`ConfigError.problems`), not just the first. A bad setting is refused before
any socket is bound, rather than surfacing later as a bind error or a failing rank.

Each setting is declared once: the fields of `DaemonConfig` and `EngineArgs` give keys, types and
defaults, and a field's `msgspec.Meta(description=...)` (on `DaemonConfig` or `EngineArgs`) its
`--help` text; `FLAGS` gives the command-line spelling; environment names derive from keys.

One rule holds in every layer: for an optional setting an empty string means "unset" (`None`).
That is the only way to say `None` in TOML or in the environment, e.g. `fpm_endpoint = ""` turns
forward-pass metrics off and `ENGINED_MAX_NUM_SEQS=` lifts the running-request limit.

The package has one module per job: `schema` (the struct), `fields` (reflection over its
fields, environment names), `flags` (command-line spellings), `endpoints` (endpoint grammar),
`api_keys` (what an HTTP API key may be, the key file), `kv_events_config` (vLLM's
`--kv-events-config` JSON onto the kv_events_* keys), `speculative_config` (vLLM's
`--speculative-config` onto the MTP keys), `loading` (the layers), `validation` (the single
pass), `toml_writer` (`--print-config`).
"""

from engined.config.endpoints import endpoint_for_rank
from engined.config.fields import ENV_ALLOWLIST, ENV_PREFIX, env_name
from engined.config.flags import FLAGS, Flag
from engined.config.kv_events_config import kv_events_flags
from engined.config.loading import load_config
from engined.config.schema import (
    ConfigError,
    DaemonConfig,
    KvEventsFormat,
    LogFormat,
    LogLevel,
    Port,
)
from engined.config.speculative_config import speculative_flags
from engined.config.toml_writer import dump_config

__all__ = [
    "ENV_ALLOWLIST",
    "ENV_PREFIX",
    "FLAGS",
    "ConfigError",
    "DaemonConfig",
    "Flag",
    "KvEventsFormat",
    "LogFormat",
    "LogLevel",
    "Port",
    "dump_config",
    "endpoint_for_rank",
    "env_name",
    "kv_events_flags",
    "load_config",
    "speculative_flags",
]
