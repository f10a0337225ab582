"""The one map between modelled time and wall time.

The core lives in modelled milliseconds only: pass durations, KV transfer delays, tier
deadlines, request arrivals and finishes are all on one modelled clock, whatever the pacing.
`speedup_ratio` says how fast that clock runs against the wall: at r > 0 one wall second is
r modelled seconds; at 0 nothing is paced (the engine loop drives a virtual clock and no one
waits). Everything that turns modelled time into a wait, a deadline or a wall-time field
asks a `ModelClock`, so the ratio is applied in exactly one place.
"""

from __future__ import annotations

from typing import Final


class ModelClock:
    """Modelled milliseconds to wall seconds and back at one speedup ratio (0: unpaced).

    Divisions keep the order `ms / 1000.0 / r` and `s * 1000.0 * r`, so at ratio 1 the
    results are bit for bit the unscaled ones and a paced daemon keeps its old deadlines.
    """

    __slots__ = ("paced", "speedup_ratio")

    def __init__(self, speedup_ratio: float) -> None:
        ratio = float(speedup_ratio)
        # NaN and negatives are refused by the config; here they simply mean "unpaced".
        self.paced: Final[bool] = ratio > 0.0
        self.speedup_ratio: Final[float] = ratio if self.paced else 0.0

    def to_wall_s(self, modelled_ms: float) -> float:
        """How long `modelled_ms` lasts on the wall (0.0 unpaced: nothing waits for it)."""
        if not self.paced:
            return 0.0
        return modelled_ms / 1000.0 / self.speedup_ratio

    def to_modelled_ms(self, wall_s: float) -> float:
        """How much modelled time `wall_s` of the wall is (0.0 unpaced: the modelled clock
        does not follow the wall; the engine loop's virtual clock moves it)."""
        if not self.paced:
            return 0.0
        return wall_s * 1000.0 * self.speedup_ratio

    def reported_s(self, modelled_s: float) -> float:
        """The pass time a forward-pass metric's `wall_time` reports: wall seconds when
        paced, the modelled seconds themselves unpaced (the mocker's unscaled duration).
        A wire contract kept as upstream's mocker has it, not a wait."""
        if not self.paced:
            return modelled_s
        return modelled_s / self.speedup_ratio

    def __repr__(self) -> str:
        return f"ModelClock(speedup_ratio={self.speedup_ratio})"
