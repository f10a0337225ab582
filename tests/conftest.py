"""Which core the tests run against: pure Python or the mypyc build (setup.py, ENGINED_MYPYC=1).

The header of every run names it. A partial or stale build (a source edited after its `.so`
was built, which Python would silently ignore) stops the run, and so does a mode other than
`ENGINED_EXPECT_COMPILED` (1: compiled, 0: pure Python) when that is set, as CI sets it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import engined.core


def pytest_report_header() -> str:
    return f"engined core: {engined.core.build()}"


def _stale() -> list[str]:
    stale: list[str] = []
    for name in engined.core.compiled_modules():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        extension = Path(spec.origin)
        source = extension.with_name(name.rpartition(".")[2] + ".py")
        if source.stat().st_mtime > extension.stat().st_mtime:
            stale.append(f"{source} is newer than {extension.name}")
    return stale


def pytest_configure(config: pytest.Config) -> None:
    build = engined.core.build()
    rebuild = "rebuild (ENGINED_MYPYC=1 pip install -e .) or delete the .so files"
    compiled = engined.core.compiled_modules()
    if compiled and not engined.core.compiled():
        raise pytest.UsageError(f"engined core: {build}: {rebuild}")
    if stale := _stale():
        raise pytest.UsageError(f"engined core: stale compiled modules ({stale[0]}): {rebuild}")
    # Popped: the daemons the tests start refuse ENGINED_* variables they do not know.
    expect = os.environ.pop("ENGINED_EXPECT_COMPILED", None)
    if expect is not None and (expect == "1") != engined.core.compiled():
        raise pytest.UsageError(f"ENGINED_EXPECT_COMPILED={expect} but the core is {build}")
