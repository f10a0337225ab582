"""When a connection that waits for its client gives up: keep-alive, request head, request body.

Apart from `engined.openai.http.http_connection` because the timing is its own small machine: one
deadline at a time on one lazy asyncio timer. A timer that fires early re-arms for the deadline
then in force, so a request on a kept-alive connection costs no timer operation; only a
deadline earlier than the pending timer moves it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engined.openai.http.limits import HttpLimits
from engined.openai.http.parsing import RequestReader


class WaitDeadline:
    """The deadline of the phase `reader` is in; `expired()` is called once it passes.

    The connection arms it only while the server waits for the client (no handler running,
    no parsed request queued) and checks that again when it expires.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limits: HttpLimits,
        reader: RequestReader,
        expired: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._limits = limits
        self._reader = reader
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None

    def arm(self) -> None:
        """Set the deadline of the reader's phase (none once it is dead)."""
        reader = self._reader
        limits = self._limits
        if reader.phase == "wait":
            deadline = self._loop.time() + limits.keep_alive_s
        elif reader.phase == "head":
            deadline = reader.phase_since + limits.head_timeout_s
        elif reader.phase == "body":
            deadline = reader.phase_since + limits.body_timeout_s
        else:
            self._deadline = None
            return
        self._deadline = deadline
        if self._timer is not None and self._timer.when() > deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._fire)

    def cancel(self) -> None:
        """No deadline; the pending timer, if any, finds none and does nothing."""
        self._deadline = None

    def stop(self) -> None:
        """Cancel the timer itself: the connection is gone."""
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        if self._deadline is None:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._fire)
            return
        self._deadline = None
        self._expired()
