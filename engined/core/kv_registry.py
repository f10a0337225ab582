"""Which G1 blocks the requests of one rank hold.

The KV manager keeps these maps beside its `BlockPool`; the offload tiers' G1 glue reads and
updates them too, without seeing the manager itself. Which blocks are registered is the
pool's to say (`BlockPool.is_registered`); a registered key names its block's sequence hash
(`hashing.hash_of_key`).
"""

from __future__ import annotations


class BlockRegistry:
    """`active_full`: sequence hash -> block id, with `holders[block id]` the handles held
    through this map (a list by block id: a count per entry would be an object per block);
    `active_partial`: partial-block id -> slot."""

    __slots__ = ("active_full", "active_partial", "holders")

    def __init__(self, num_blocks: int) -> None:
        self.active_full: dict[int, int] = {}
        self.holders: list[int] = [0] * num_blocks
        self.active_partial: dict[int, int] = {}
