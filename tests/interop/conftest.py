from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.peers import require_peers


@pytest.fixture
def peers_python() -> Path:
    """The peers venv's interpreter (skip without it; fail under CI)."""
    return require_peers()
