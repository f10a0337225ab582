"""Which core the tests run against: the compiled one (setup.py's default) or pure Python.

The header of every run names it, and why it is the pure one. A stale or partial build
cannot run: engined.core then imports every compiled module from its source
(engined/core/core_build.py). `ENGINED_EXPECT_COMPILED` (1: compiled, 0: pure Python), as CI
sets it, stops a run against the other core.
"""

from __future__ import annotations

import os

import pytest

import engined.core


def pytest_report_header() -> str:
    return f"engined core: {engined.core.build()}"


def pytest_configure(config: pytest.Config) -> None:
    # Popped: the daemons the tests start refuse ENGINED_* variables they do not know.
    expect = os.environ.pop("ENGINED_EXPECT_COMPILED", None)
    if expect is not None and (expect == "1") != engined.core.compiled():
        raise pytest.UsageError(
            f"ENGINED_EXPECT_COMPILED={expect} but the core is {engined.core.build()}"
        )
    # Every daemon a test starts runs without the OpenAI API server (its default port, 8000,
    # would be shared by every test at once); tests of the API server pass `--port`.
    os.environ["ENGINED_API_PORT"] = ""
