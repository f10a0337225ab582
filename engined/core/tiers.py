"""The core's offload-tier surface: ticks between passes, the next deadline, tier gauges.

Passes tick the tiers themselves (engined/core/scheduler.py). These calls let a caller
advance them without a pass: an offline replay finishes the transfers due at a timestamp
before the pass at that timestamp, and a live daemon whose core has nothing else to do wakes
at the earliest transfer deadline to land it and publish its events. Without offload tiers
every call is a cheap no-op.
"""

from __future__ import annotations

import msgspec

from engined.core.commands import CommandHandling
from engined.core.offload.parking import ParkedSwapIn
from engined.core.offload.tier_engine import TierEngine
from engined.core.types import EngineMetrics, LifecycleEvent, OffloadTickEffects


class TierHandling(CommandHandling):
    """The offload half of VllmCore's public API."""

    @property
    def requests_awaiting_swap_in(self) -> list[ParkedSwapIn]:
        """Requests parked on a lower-tier prefix copy, in park order."""
        return self.swap_ins.parked

    def attach_offload_engine(self, engine: TierEngine) -> None:
        """Give this core lower tiers built elsewhere (tests; `args` build them otherwise)."""
        self.kv.attach_offload(engine)

    def earliest_offload_deadline(self) -> float | None:
        """The next time a tier transfer completes; None without tiers or transfers."""
        offload = self.kv.offload
        return offload.engine.earliest_pending_deadline() if offload is not None else None

    def tick_offload_only(self, now_ms: float) -> OffloadTickEffects:
        """Advance the tiers to `now_ms` between passes, then retry the pending destination.

        Returns the KV events buffered so far (the tick's included), which the caller
        publishes, and the destination reservation the retry made, if any.
        """
        lifecycle: list[LifecycleEvent] = []
        if self.kv.offload is not None:
            self.swap_ins.tick_and_promote(self, now_ms)
            lifecycle = self.retry_pending_destinations()
        return OffloadTickEffects(self.kv.take_events(), lifecycle)

    def tick_offload_transport_only(self, now_ms: float) -> OffloadTickEffects:
        """`tick_offload_only` without the pending-destination retry."""
        if self.kv.offload is not None:
            self.swap_ins.tick_and_promote(self, now_ms)
        return OffloadTickEffects(self.kv.take_events(), [])


def tier_metrics(metrics: EngineMetrics, engine: TierEngine) -> EngineMetrics:
    """`metrics` with the G2/G3 pool gauges filled in."""
    g2 = engine.g2.pool
    g3 = engine.g3.pool if engine.g3 is not None else None
    return msgspec.structs.replace(
        metrics,
        g2_active_blocks=g2.num_active,
        g2_inactive_blocks=g2.num_inactive,
        g2_total_blocks=g2.num_blocks,
        g3_active_blocks=g3.num_active if g3 is not None else 0,
        g3_inactive_blocks=g3.num_inactive if g3 is not None else 0,
        g3_total_blocks=g3.num_blocks if g3 is not None else 0,
    )
