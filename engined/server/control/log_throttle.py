"""At most a burst of log lines per client per interval, then a count of what was held back.

A flood of malformed messages from one client would otherwise write one warning per message
(100,000 frames, 100,000 lines): the log is shared by every client and by the operator, and
writing it costs the loop time. The first lines of a burst keep the detail a developer needs;
the rest are counted and the count rides on the next line that is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Final

BURST: Final = 10
INTERVAL_S: Final = 1.0
# Keys (client identities) remembered at most; older windows are forgotten first.
MAX_KEYS: Final = 4096


class LogThrottle:
    def __init__(
        self,
        *,
        burst: int = BURST,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = burst
        self._interval = interval_s
        self._clock = clock
        # key -> [window start, lines written in it, lines held back since the last written]
        self._windows: dict[Hashable, list[float]] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: hold this line back. Else log it, with this many held back since the last."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self._interval:
            held = 0 if window is None else int(window[2])
            if window is None and len(self._windows) >= MAX_KEYS:
                del self._windows[next(iter(self._windows))]
            self._windows.pop(key, None)
            self._windows[key] = [now, 1.0, 0.0]
            return held
        if window[1] < self._burst:
            window[1] += 1
            held = int(window[2])
            window[2] = 0.0
            return held
        window[2] += 1
        return None
