"""Values that cross between the tier engine and its G1 glue (g1_glue.py).

The engine never mints event ids and never touches G1: it returns event drafts (the glue
numbers and publishes them in the rank's event log) and hands G1 slot ids back (the glue
frees them in the pool). G1 slots
and pins are opaque ints to the engine; it only holds them and returns each exactly once.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from engined.core.types import Medium, OffloadWait


class BlockMeta:
    """What a router needs to name one block: the fields of its Stored event.

    `parent_hash` is the sequence hash of the block before it (None at the root);
    `local_hash` and `token_ids` are None when the G1 side did not have them.
    """

    __slots__ = ("local_hash", "parent_hash", "seq_hash", "token_ids")

    def __init__(
        self,
        seq_hash: int,
        parent_hash: int | None,
        local_hash: int | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        self.seq_hash = seq_hash
        self.parent_hash = parent_hash
        self.local_hash = local_hash
        self.token_ids = token_ids

    def __repr__(self) -> str:
        return f"BlockMeta(seq_hash={self.seq_hash}, parent_hash={self.parent_hash})"


class EvictedBlock:
    """A registered G1 block that G1 allocation just evicted, offered to G2.

    `slot` is the evicted block's G1 id, which the allocation reuses: the engine holds it
    (it stays an active G1 block) until the copy leaves G1. `key`/`parent_key` are lineage
    keys (`hashing.lineage_key`), identical in every tier. `meta` None publishes nothing.
    """

    __slots__ = ("key", "meta", "parent_key", "slot")

    def __init__(self, slot: int, key: int, parent_key: int | None, meta: BlockMeta | None) -> None:
        self.slot = slot
        self.key = key
        self.parent_key = parent_key
        self.meta = meta


class TierEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


class TierEvent:
    """One lower-tier KV event draft, one block each, as upstream publishes them.

    The manager turns it into `BlockStored` (`parent_hash`, `[seq_hash]`, the local hash and
    tokens when known) or `BlockRemoved` (`[seq_hash]`) with `medium` and a fresh event id.
    """

    __slots__ = ("block", "kind", "medium")

    def __init__(self, kind: TierEventKind, medium: Medium, block: BlockMeta) -> None:
        self.kind = kind
        self.medium = medium
        self.block = block

    def __repr__(self) -> str:
        return f"TierEvent({self.kind.value}, {self.medium.value}, {self.block.seq_hash})"


class LandedOnboard(NamedTuple):
    """A completed onboard taken from the engine: its G1 slots and the prefix pins."""

    slots: list[int]
    pins: list[int]


class ReapedOnboard:
    """A cancelled onboard whose transfer ended: its G1 slots and prefix pins come back."""

    __slots__ = ("onboard_id", "pins", "slots")

    def __init__(self, onboard_id: int, slots: list[int], pins: list[int]) -> None:
        self.onboard_id = onboard_id
        self.slots = slots
        self.pins = pins


class TickEffects:
    """What one tick changed that the G1 glue must act on, in this order.

    1. publish `events` (in order; they happened in this order in the tiers),
    2. free `released_g1_slots` (mutable slots: back to the free list) and, per reaped
       onboard, its `slots` (free) and `pins` (drop one handle each).

    `released_count` is upstream's `acknowledge_tick` count of what came back; the engine's
    one capacity generation (engined/core/capacity.py) moves when G1 blocks free up.

    `completed_onboards` lists onboards whose G2->G1 transfer finished at this tick; their
    status is COMPLETED until the caller takes them.
    """

    __slots__ = ("completed_onboards", "events", "reaped_onboards", "released_g1_slots")

    def __init__(self) -> None:
        self.events: list[TierEvent] = []
        self.released_g1_slots: list[int] = []
        self.completed_onboards: list[int] = []
        self.reaped_onboards: list[ReapedOnboard] = []

    @property
    def released_count(self) -> int:
        """Upstream's `acknowledge_tick` count: source slots plus reaped slots and pins."""
        reaped = sum(len(r.slots) + len(r.pins) for r in self.reaped_onboards)
        return len(self.released_g1_slots) + reaped


class RetryNow:
    """Nothing had to wait: the engine already ticked, and the caller retries once.

    `effects` is that tick's outcome (apply it like any tick's); the evicted blocks' G1
    source slots are among its `released_g1_slots`.
    """

    __slots__ = ("effects",)

    def __init__(self, effects: TickEffects) -> None:
        self.effects = effects

    @property
    def released_slots(self) -> list[int]:
        return self.effects.released_g1_slots

    def __repr__(self) -> str:
        return f"RetryNow(released={self.effects.released_count})"


OffloadOutcome = OffloadWait | RetryNow


class OnboardState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class OnboardStatus:
    """An onboard's state and the number of blocks it will land (0 while staging from G3)."""

    __slots__ = ("block_count", "state")

    def __init__(self, state: OnboardState, block_count: int) -> None:
        self.state = state
        self.block_count = block_count

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OnboardStatus):
            return NotImplemented
        return self.state is other.state and self.block_count == other.block_count

    def __hash__(self) -> int:
        return hash((self.state, self.block_count))

    def __repr__(self) -> str:
        return f"OnboardStatus({self.state.value}, {self.block_count})"
