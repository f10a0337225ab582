"""vLLM 0.33's filesystem LoRA resolver plugin: a request naming an adapter nobody loaded finds
it in a cache directory, and the API server loads it on the fly.

vLLM loads its general plugins at start (all of them, or those `VLLM_PLUGINS` names), and its
`lora_filesystem_resolver` registers itself when `VLLM_LORA_RESOLVER_CACHE_DIR` is set
(vllm/plugins/lora_resolvers/filesystem_resolver.py); `_check_model` asks it, only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, for a `model` that is neither served nor loaded. It takes
`{cache_dir}/{model}` when that directory has an `adapter_config.json` whose `peft_type` is
`"LORA"` and whose `base_model_name_or_path` is the model the server was started with.

Two refusals are engined's own, where vLLM's resolver would read outside its directory: a name
that is absolute or climbs out of the cache directory (`../x`) resolves to nothing, and an
`adapter_config.json` over 1 MiB is malformed. A malformed one (not JSON, not an object,
without either key) is a 500 naming the problem, where vLLM raises whatever `json` or the
lookup raised. The Hugging Face hub resolver (`lora_hf_hub_resolver`) downloads, which
engined never does: `VLLM_LORA_RESOLVER_HF_REPO_LIST` is warned about and ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from engined.config import ConfigError
from engined.openai.api_errors import ApiError

log = structlog.get_logger(__name__)

CACHE_DIR_ENV: Final = "VLLM_LORA_RESOLVER_CACHE_DIR"
PLUGINS_ENV: Final = "VLLM_PLUGINS"
HF_REPO_LIST_ENV: Final = "VLLM_LORA_RESOLVER_HF_REPO_LIST"
FILESYSTEM_PLUGIN: Final = "lora_filesystem_resolver"
CONFIG_FILE: Final = "adapter_config.json"
CONFIG_MAX_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class FilesystemResolver:
    """Adapters under `cache_dir`, one directory per adapter name."""

    cache_dir: Path

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        """The adapter's path when `lora_name` is a LoRA adapter of `base_model_name` in the
        cache directory, else None.

        Raises:
            ApiError: 500, its `adapter_config.json` is malformed.
        """
        if os.path.isabs(lora_name) or ".." in Path(lora_name).parts:
            return None
        path = os.path.join(self.cache_dir, lora_name)
        config_path = os.path.join(path, CONFIG_FILE)
        if not os.path.exists(path) or not os.path.exists(config_path):
            return None
        config = _read_config(lora_name, config_path)
        if config["peft_type"] == "LORA" and config["base_model_name_or_path"] == base_model_name:
            return path
        return None


def _read_config(lora_name: str, config_path: str) -> dict[str, object]:
    def malformed(problem: str) -> ApiError:
        message = f"LoRA adapter '{lora_name}': its {CONFIG_FILE} {problem}"
        return ApiError(500, message, "InternalServerError")

    try:
        with open(config_path, "rb") as file:
            data = file.read(CONFIG_MAX_BYTES + 1)
    except OSError as error:
        raise malformed(f"cannot be read ({error.strerror})") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise malformed(f"is over {CONFIG_MAX_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise malformed("is not JSON") from None
    if not isinstance(config, dict):
        raise malformed("is not a JSON object")
    for key in ("peft_type", "base_model_name_or_path"):
        if key not in config:
            raise malformed(f"has no '{key}'")
    return config


def filesystem_resolver(env: Mapping[str, str]) -> FilesystemResolver | None:
    """The resolver vLLM's plugins would register from `env`, if any.

    Raises:
        ConfigError: the cache directory is not a directory (vLLM does not start either).
    """
    plugins = env.get(PLUGINS_ENV)
    if env.get(HF_REPO_LIST_ENV):
        log.warning(
            "the Hugging Face hub LoRA resolver is not served: engined downloads nothing",
            variable=HF_REPO_LIST_ENV,
        )
    cache_dir = env.get(CACHE_DIR_ENV)
    if not cache_dir:
        return None
    if plugins is not None and FILESYSTEM_PLUGIN not in plugins.split(","):
        return None
    if not os.path.isdir(cache_dir):
        raise ConfigError(
            f"{CACHE_DIR_ENV} must be set to a valid directory for Filesystem Resolver "
            f"plugin to function, got {cache_dir!r}"
        )
    return FilesystemResolver(Path(cache_dir))
