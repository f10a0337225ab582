"""JSON Schemas of every wire format, generated from the structs that encode them.

`python -m engined.wire.schemas [DIR]` (re)writes `proto/schemas/`; `tests/wire` fails when the
committed files differ from `render_schemas()`, so a struct change cannot ship with stale docs.
The schemas describe the msgpack payloads in JSON terms: a msgpack map is an `object`, an
array-like struct an `array` with `prefixItems`, and `bytes` (vLLM's digest hashes, which
engined never sends) appears as a base64 `string`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final

import msgspec

from engined.wire import control, fpm_schema, kv_events

SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
DEFAULT_DIR: Final = Path(__file__).resolve().parents[2] / "proto" / "schemas"

# file name -> (root type, title, description)
_DOCUMENTS: Final[dict[str, tuple[Any, str, str]]] = {
    "control-client.json": (
        control.ClientMessage,
        "engined control protocol v1: client -> daemon",
        "One msgpack map per message, tagged by `type`; unknown keys are refused. String ids "
        "are limited in UTF-8 bytes (request_id, handoff_id: 256; id: 128), which JSON Schema "
        "cannot express.",
    ),
    "control-daemon.json": (
        control.DaemonMessage,
        "engined control protocol v1: daemon -> client",
        "Direct replies echo the client's `id`; `output` and `lifecycle` are streamed. "
        "Fields shown with a null default are left out when absent; clients must ignore "
        "unknown keys.",
    ),
    "kv-events-vllm.json": (
        kv_events.KVEventBatch,
        "KV cache event batch, format `vllm` (vLLM 0.33 map events)",
        "[ts, events, data_parallel_rank]; events are tagged maps. engined sends block hashes "
        "as ints in [2**32, 2**64), `extra_keys` as one null per block, group_idx 0, "
        'kv_cache_spec_kind "full_attention".',
    ),
    "kv-events-vllm-array.json": (
        kv_events.ArrayKVEventBatch,
        "KV cache event batch, format `vllm-array` (vLLM 0.22/0.23 positional events)",
        "[ts, events, data_parallel_rank]; each event is an array whose element 0 is the tag.",
    ),
    "fpm.json": (
        fpm_schema.ForwardPassMetrics,
        "Dynamo ForwardPassMetrics v1",
        "One msgpack map per executed pass, every key present in this order; all zeros with "
        "wall_time 0.0 is an idle heartbeat.",
    ),
}


def _document(root: Any, title: str, description: str) -> dict[str, Any]:
    (schema,), components = msgspec.json.schema_components([root], ref_template="#/$defs/{name}")
    doc: dict[str, Any] = {"$schema": SCHEMA_DIALECT, "title": title, "description": description}
    doc.update(schema)
    doc["$defs"] = dict(sorted(components.items()))
    return doc


def render_schemas() -> dict[str, str]:
    """The expected contents of each file in `proto/schemas/`, by file name."""
    return {
        name: json.dumps(_document(*spec), indent=2, ensure_ascii=False) + "\n"
        for name, spec in _DOCUMENTS.items()
    }


def write_schemas(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Write every schema file into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_schemas(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR):
        print(written_path)
