"""Which G1 blocks the requests of one rank hold.

The KV manager keeps these beside its `BlockPool`. Which blocks are registered is the pool's
to say (`BlockPool.registered`: lineage key -> slot); a registered key names its block's
sequence hash (`hashing.hash_of_key`).
"""

from __future__ import annotations


class BlockRegistry:
    """`holders[slot]`: how many requests hold the full block in `slot` (0 for a block held
    by none: inactive, pinned, or not a registered block at all); a registered block with
    holders is what a request can share. `active_partial`: partial-block id -> slot."""

    __slots__ = ("active_partial", "holders")

    def __init__(self, num_blocks: int) -> None:
        self.holders: list[int] = [0] * num_blocks
        self.active_partial: dict[int, int] = {}
