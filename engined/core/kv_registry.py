"""Which G1 blocks the requests of one rank hold, and what of a sequence is resident.

The KV manager keeps these beside its `BlockPool`. Which blocks are registered is the pool's
to say (`BlockPool.registered`: lineage key -> slot, shared here, not copied); a registered
key names its block's sequence hash (`hashing.hash_of_key`). The questions a prefill cost or
an inspection asks of the pool (how much of a prompt is resident, which slots a request
holds) need only these maps, so they are answered here and never change the pool.
"""

from __future__ import annotations

from typing import NamedTuple

from engined.core.sequence import Sequence


class ResidentPrefix(NamedTuple):
    blocks: int
    active: int


class BlockRegistry:
    """`holders[slot]`: how many requests hold the full block in `slot` (0 for a block held
    by none: inactive, pinned, or not a registered block at all); a registered block with
    holders is what a request can share. `active_partial`: partial-block id -> slot."""

    __slots__ = ("active_partial", "holders", "registered")

    def __init__(self, num_blocks: int, registered: dict[int, int]) -> None:
        self.holders: list[int] = [0] * num_blocks
        self.active_partial: dict[int, int] = {}
        self.registered = registered

    def resident_prefix(self, seq: Sequence) -> ResidentPrefix:
        """The leading blocks of `seq` resident here, and how many of them are active."""
        overlap = active = 0
        if seq.caching:
            registered = self.registered
            holders = self.holders
            for key in seq.keys:
                slot = registered.get(key)
                if slot is None:
                    break
                overlap += 1
                if holders[slot]:
                    active += 1
        return ResidentPrefix(overlap, active)

    def held_slot(self, key: int) -> int | None:
        """The slot of the full block registered under `key` if requests hold it, else None."""
        slot = self.registered.get(key)
        return slot if slot is not None and self.holders[slot] else None

    def active_block_ids(self, seq: Sequence) -> list[int]:
        """The slots `seq` holds: its full blocks in order, then its partial block."""
        ids: list[int] = []
        for key in seq.keys:
            slot = self.held_slot(key)
            if slot is not None:
                ids.append(slot)
        if seq.partial is not None and seq.partial in self.active_partial:
            ids.append(self.active_partial[seq.partial])
        return ids
