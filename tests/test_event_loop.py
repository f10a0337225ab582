"""engined.event_loop.run: uvloop's loop where uvloop imports (a dependency on Linux), else
asyncio's; the daemon, its rank workers, API servers and the Dynamo worker run on it."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from engined import event_loop


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_runs_on_uvloop_where_it_imports() -> None:
    assert event_loop.run(loop_module()).startswith("uvloop")


def test_falls_back_on_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_uvloop)
    assert event_loop.run(loop_module()).startswith("asyncio")


def test_returns_the_coroutine_s_result_and_raises_its_error() -> None:
    async def answer() -> int:
        return 42

    async def fail() -> None:
        raise ValueError("from the coroutine")

    assert event_loop.run(answer()) == 42
    with pytest.raises(ValueError, match="from the coroutine"):
        event_loop.run(fail())
