"""Helpers shared by the test packages (plain functions; fixtures live in conftest.py files).

`run` bounds an async scenario and runs it in a fresh event loop; `until` waits, bounded, for
state that other tasks of the loop change; `free_tcp_port` finds a loopback port nothing
listens on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

SCENARIO_TIMEOUT_S = 60.0


def run(scenario: Awaitable[T], timeout: float = SCENARIO_TIMEOUT_S) -> T:
    """Run an async scenario in a fresh event loop, bounded by `timeout`."""

    async def bounded() -> T:
        return await asyncio.wait_for(scenario, timeout)

    return asyncio.run(bounded())


def free_tcp_port() -> int:
    """An ephemeral loopback port, found by binding port 0 and releasing it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def until(
    condition: Callable[[], object],
    what: str = "the condition",
    *,
    timeout: float = 20.0,
    poll_s: float = 0.005,
) -> None:
    """Yield to the event loop (`poll_s` between looks) until `condition()` holds; fails
    naming `what` after `timeout`, which only bounds a broken run."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: timed out"
        await asyncio.sleep(poll_s)
