"""Links as the engine drives them: completions noted when seen, acted on at the next tick.

Upstream's worker drains a pair of links (offload and onboard share one lock and one id
counter) whenever it reserves a transfer on either, not only at ticks. Transfers that finish
during such a drain are done, but their effects (G2 registration, source release, onboard
status) surface at the next tick, when upstream settles its pipelines. A `Lane` keeps those
early completions, in order, until the tick takes them, and reports the time it saw them as a
deadline so a stall-advancing scheduler still ticks.
"""

from __future__ import annotations

import itertools

from engined.core.offload.link import BandwidthLink


class Lane:
    __slots__ = ("_done", "_seen_at", "link")

    def __init__(self, link: BandwidthLink) -> None:
        self.link = link
        self._done: list[int] = []
        self._seen_at: float | None = None

    def drain(self, now_ms: float) -> None:
        done = self.link.advance_to(now_ms)
        if done:
            self._done.extend(done)
            if self._seen_at is None:
                self._seen_at = now_ms

    def take(self) -> list[int]:
        """Completed transfer ids not yet acted on, in completion order."""
        done = self._done
        self._done = []
        self._seen_at = None
        return done

    def deadline(self) -> float | None:
        finish = self.link.earliest_finish()
        seen = self._seen_at
        if seen is None:
            return finish
        return seen if finish is None else min(seen, finish)

    def is_idle(self) -> bool:
        return self.link.is_idle() and not self._done


class LanePair:
    """An offload and an onboard link with one id counter, drained together."""

    __slots__ = ("offload", "onboard")

    def __init__(self, offload_gbps: float, onboard_gbps: float) -> None:
        ids = itertools.count()
        self.offload = Lane(BandwidthLink(offload_gbps, ids))
        self.onboard = Lane(BandwidthLink(onboard_gbps, ids))

    def drain(self, now_ms: float) -> None:
        self.offload.drain(now_ms)
        self.onboard.drain(now_ms)

    def deadline(self) -> float | None:
        deadlines = [d for d in (self.offload.deadline(), self.onboard.deadline()) if d is not None]
        return min(deadlines) if deadlines else None

    def is_idle(self) -> bool:
        return self.offload.is_idle() and self.onboard.is_idle()
