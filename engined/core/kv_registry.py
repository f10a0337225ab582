"""Which G1 blocks the requests of one rank hold, and which blocks were ever registered.

The KV manager keeps these maps beside its `BlockPool`; the offload tiers' G1 glue reads and
updates them too (a block offloaded out of G1 leaves `registered`, an onboarded one joins
it), without seeing the manager itself.
"""

from __future__ import annotations


class BlockRegistry:
    """`active_full`: sequence hash -> [block id, handles held through this map];
    `active_partial`: partial-block id -> slot; `registered`: lineage key -> sequence hash,
    for every block registered in G1 (published or not)."""

    __slots__ = ("active_full", "active_partial", "registered")

    def __init__(self) -> None:
        self.active_full: dict[int, list[int]] = {}
        self.active_partial: dict[int, int] = {}
        self.registered: dict[int, int] = {}
