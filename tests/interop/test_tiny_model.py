"""Building the tests' tiny model under an interpreter without `tokenizers` names the
install line that brings it (a bare venv has no `tokenizers`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.interop.tiny_model import TOKENIZERS_INSTALL, build_tiny_model


def test_a_missing_tokenizers_names_the_install_line(tmp_path: Path) -> None:
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    with pytest.raises(RuntimeError) as info:
        build_tiny_model(tmp_path / "model", python=python)
    message = str(info.value)
    assert message.startswith(f"building the tiny model under {python} failed:\n"), message
    assert message.endswith(
        f"\n{python} lacks `tokenizers`, which comes with engined: install the peers venv as "
        f"the README's 'Behind NVIDIA Dynamo' install does, e.g. {TOKENIZERS_INSTALL}"
    ), message
    assert TOKENIZERS_INSTALL == ".venv-peers/bin/pip install -e '.[dynamo]'"
