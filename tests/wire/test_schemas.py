"""proto/schemas is generated from the structs; a struct change must regenerate it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engined.wire import schemas
from tests.wire._paths import SCHEMAS_DIR

RENDERED = schemas.render_schemas()


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_committed_schema_is_current(name: str) -> None:
    path = SCHEMAS_DIR / name
    assert path.exists(), f"{name} missing: run `python -m engined.wire.schemas`"
    assert path.read_text(encoding="utf-8") == RENDERED[name], (
        f"{name} is stale: run `python -m engined.wire.schemas`"
    )


def test_no_stale_schema_files() -> None:
    assert {path.name for path in SCHEMAS_DIR.glob("*.json")} == set(RENDERED)


def test_schemas_are_2020_12_documents() -> None:
    for text in RENDERED.values():
        doc = json.loads(text)
        assert doc["$schema"] == schemas.SCHEMA_DIALECT
        assert doc["title"] and doc["$defs"]


def test_control_client_schema_is_closed_and_tagged() -> None:
    doc = json.loads(RENDERED["control-client.json"])
    mapping = doc["discriminator"]["mapping"]
    assert doc["discriminator"]["propertyName"] == "type"
    assert len(mapping) == 23 and "wait_idle" in mapping and "release_kv_cache_memory" in mapping
    assert doc["$defs"]["Metrics"]["properties"]["accept"]["anyOf"][0]["maxLength"] == 4096
    assert all(d.get("additionalProperties") is False for d in doc["$defs"].values())
    token_id = doc["$defs"]["WireRequest"]["properties"]["token_ids"]
    assert token_id["minItems"] == 1
    assert token_id["items"]["exclusiveMaximum"] == 2**32


def test_write_schemas(tmp_path: Path) -> None:
    written = schemas.write_schemas(tmp_path)
    assert {path.name: path.read_text(encoding="utf-8") for path in written} == RENDERED
