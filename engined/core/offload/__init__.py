"""Host (G2) and disk (G3) KV tiers below the GPU pool: mocker 1.3.0's `kvbm-offload` feature.

Pure building blocks the KV manager owns: the offload configuration, the processor-sharing
bandwidth link, and `OffloadEngine`, which models the observable contract of the Rust
`MockOffloadEngine` in virtual time (every method takes `now_ms` from the caller).
"""

from engined.core.offload.config import OffloadConfig
from engined.core.offload.engine import OffloadEngine
from engined.core.offload.link import BandwidthLink
from engined.core.offload.swap_in import OnboardPlan
from engined.core.offload.types import (
    Blocked,
    BlockMeta,
    EvictedBlock,
    OffloadOutcome,
    ReapedSwapIn,
    RetryNow,
    SwapInState,
    SwapInStatus,
    TickEffects,
    TierEvent,
    TierEventKind,
)

__all__ = [
    "BandwidthLink",
    "BlockMeta",
    "Blocked",
    "EvictedBlock",
    "OffloadConfig",
    "OffloadEngine",
    "OffloadOutcome",
    "OnboardPlan",
    "ReapedSwapIn",
    "RetryNow",
    "SwapInState",
    "SwapInStatus",
    "TickEffects",
    "TierEvent",
    "TierEventKind",
]
