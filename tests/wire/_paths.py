"""Where the committed contract files live, for tests that compare against them."""

from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
GOLDEN_DIR = PROTO_DIR / "golden"
SCHEMAS_DIR = PROTO_DIR / "schemas"


def read_golden(name: str) -> bytes:
    return (GOLDEN_DIR / name).read_bytes()
