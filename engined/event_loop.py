"""The event loop every long-running engined process runs on: uvloop where it is installed
(a dependency on Linux and macOS), else asyncio's own.

uvloop (libuv, in C) runs the same coroutines for less CPU per wake-up, and a paced daemon
wakes once per pass of every rank: with 64 ranks at speedup 1 and 32 streams (the Dynamo
cluster's shape) the daemon spent 89 µs of CPU per token on it against 96-112 µs on
asyncio's loop, passes starting no later (README "Performance"). vLLM's API server runs on
it too. Pass deadlines do not rest on its timers (libuv's are whole milliseconds): a paced
rank waits on a timerfd the loop watches (engined.server.ranks.pacer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop's loop when uvloop can be imported."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result
