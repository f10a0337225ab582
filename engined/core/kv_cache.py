"""What the engine's parts need of a rank's KV cache, whichever semantics built it.

Two pools implement it: the mocker's lineage pool (kv_manager.py, `semantics =
mocker-1.3.0`, offload tiers, TRT-LLM) and vLLM 0.33's paged pool
(paged/kv_cache_manager.py, the default). The preempter, the finisher, the token emitter and
the commands free and read KV only through this, so they serve both. A destination's
reservation is a value both pools return and take back, so it is defined here. What may
allocate takes the `now_ms` of the engine call (a pass, a tier advance, a command): with
offload tiers an allocation's evictions start their offload then. Freeing (`free_all`)
evicts nothing and takes no time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engined.core.block_moves import Use
    from engined.core.offload.g1_glue import G1Glue
    from engined.core.sequence import BlockMove, Sequence
    from engined.core.types import KvEvent, OffloadWait


class DestinationReservation:
    """KV held for an incoming transfer: a pinned cached prefix plus fresh unpublished slots."""

    __slots__ = ("prefix", "slots", "use")

    def __init__(self, prefix: list[int], slots: list[int], use: Use | None) -> None:
        self.prefix = prefix
        self.slots = slots
        self.use = use

    def block_ids(self) -> list[int]:
        return self.prefix + self.slots


class KvCache(Protocol):
    @property
    def block_size(self) -> int: ...

    @property
    def offload(self) -> G1Glue | None: ...

    @property
    def usable_blocks(self) -> int: ...

    def apply_all(self, moves: list[BlockMove], now_ms: float) -> bool: ...

    def free_all(self, moves: list[BlockMove]) -> None: ...

    def num_active_blocks(self) -> int: ...

    def num_inactive_blocks(self) -> int: ...

    def take_events(self) -> list[KvEvent]: ...

    def take_offload_wait(self) -> OffloadWait | None: ...

    def refresh_offload_wait(self, wait: OffloadWait) -> OffloadWait | None: ...

    def active_block_ids(self, seq: Sequence) -> list[int]: ...

    def reset_prefix_cache(self) -> bool: ...

    def reserve_destination(
        self, seq: Sequence, now_ms: float
    ) -> DestinationReservation | None: ...

    def activate_destination(self, res: DestinationReservation) -> None: ...

    def cancel_destination(self, res: DestinationReservation) -> None: ...
