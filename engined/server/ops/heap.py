"""Hand the heap a burst of clients left behind back to the system once the daemon is idle.

A thousand clients at once, each with a request, make the daemon's heap grow by tens of MB
(libzmq's buffers per connection, the requests, their replies). Once they are gone all of it
is freed, but glibc keeps freed memory in its arenas for reuse: after 15 rounds of 1,000
clients that connected at once, submitted and vanished, the idle daemon stayed 74 MB above
its start, and 7 MB after `malloc_trim(0)` (issue 21, 4; README, Limits and guarantees).
So when the daemon has been busy and is idle now (no request, no per-client state), it
trims. glibc only: elsewhere there is no `malloc_trim`, and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Awaitable, Callable
from typing import Final

import structlog

log = structlog.get_logger(__name__)

# How often the daemon looks whether it went idle after work.
TRIM_CHECK_S: Final = 30.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Release free heap memory to the system; whether any was released (False without
    glibc)."""
    return _TRIM is not None and bool(_TRIM(0))


async def trim_when_idle(
    idle: Callable[[], bool],
    work: Callable[[], int],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Every TRIM_CHECK_S, `trim()` if `work()` (a counter of work done: tokens) moved since
    the last trim and the daemon is `idle()`. An idle daemon trims once, not again."""
    trimmed_at = work()
    while True:
        await sleep(TRIM_CHECK_S)
        done = work()
        if done != trimmed_at and idle():
            trimmed_at = done
            log.debug("heap trimmed", released=trim())
