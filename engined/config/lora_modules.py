"""vLLM's `--lora-modules` (the `lora_modules` key) and its runtime-loading switch, read as
vLLM 0.33 reads them.

Each value is an adapter the API servers serve from their start: `name=path` when it holds a
`=` and no `,`, else a JSON object with `name`, `path` and optionally `base_model_name` (and
`is_3d_lora_weight`, a weight layout a daemon that loads no weights has no use for). An empty
value or `None` is skipped, as vLLM's `optional_type(str)` reads both as nothing. What
vLLM's `LoRAParserAction` refuses stops `vllm serve` before anything starts; here the same
words are a configuration error of `lora_modules` (`parse_lora_modules`). What vLLM refuses
only when the API server loads the adapters (an empty name or path, a duplicate, a served
model's name, no `--enable-lora`) is the API server's rule (engined.openai.served_models),
which `engined serve` runs before the daemon starts.

vLLM's `--lora-modules` is one option with one or more values; given twice, the last one
wins (its action replaces the list). `engined serve` reads a `vllm serve` command line so
(engined.cli.serve); in TOML the key is a list of these strings, `ENGINED_LORA_MODULES` one.

`VLLM_ALLOW_RUNTIME_LORA_UPDATING` (vLLM's variable, not a setting: it is read from the
environment of `engined serve`, which its API server processes inherit) adds vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` routes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

RUNTIME_LORA_UPDATING_ENV: Final = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# The fields of vLLM's `LoRAModulePath` dataclass, in its order; the first two are required.
_FIELDS: Final = ("name", "path", "base_model_name", "is_3d_lora_weight")
_REQUIRED: Final = ("name", "path")
# What vLLM's parse errors name the class (the JSON object is passed as `**kwargs`).
_CLASS: Final = "LoRAModulePath"
_QUALIFIED_CLASS: Final = "vllm.entrypoints.openai.models.protocol.LoRAModulePath"


class LoraModule(msgspec.Struct, frozen=True):
    """One `--lora-modules` adapter. `base_model_name` only counts when it names a served
    model (vLLM drops any other value, and the adapter's parent is then the first name)."""

    name: str
    path: str
    base_model_name: str | None = None


def runtime_lora_updating(env: Mapping[str, str]) -> bool:
    """vLLM's reading of `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: `1` or `true`, any case."""
    return env.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def parse_lora_modules(values: Iterable[str]) -> tuple[LoraModule, ...]:
    """The adapters of `lora_modules`, in their order.

    Raises:
        ValueError: vLLM's words for the first value it cannot read.
    """
    modules: list[LoraModule] = []
    for item in values:
        if item in ("", "None"):
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            value = json.loads(item)
        except (ValueError, RecursionError):
            # NOTE: vLLM says this for a JSONDecodeError and fails with a traceback for the
            # rest (an integer of over 4,300 digits, nesting too deep): the same words here.
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        problem = _fields_problem(value)
        if problem is not None:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {problem}")
        base = value.get("base_model_name")
        modules.append(
            LoraModule(value["name"], value["path"], base if isinstance(base, str) else None)
        )
    return tuple(modules)


def _fields_problem(value: object) -> str | None:
    """Why `LoRAModulePath(**value)` would not build, in Python's words, or None.

    One refusal is engined's: vLLM takes a `name` or `path` that is not a string here and
    fails later, at start-up, in pydantic's words.
    """
    if not isinstance(value, dict):
        kind = type(value).__name__
        return f"{_QUALIFIED_CLASS}() argument after ** must be a mapping, not {kind}"
    unexpected = next((key for key in value if key not in _FIELDS), None)
    if unexpected is not None:
        return f"{_CLASS}.__init__() got an unexpected keyword argument '{unexpected}'"
    missing = [f"'{name}'" for name in _REQUIRED if name not in value]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        return (
            f"{_CLASS}.__init__() missing {len(missing)} required positional "
            f"argument{plural}: {' and '.join(missing)}"
        )
    for name in _REQUIRED:
        if not isinstance(value[name], str):
            return f"'{name}' must be a string, got {type(value[name]).__name__}"
    return None
