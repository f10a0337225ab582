"""Small builders for offload tests: lineage keys, router metadata, evicted blocks."""

from __future__ import annotations

from typing import Any

from engined.core.hashing import lineage_key
from engined.core.offload.config import OffloadConfig
from engined.core.offload.tier_engine import TierEngine
from engined.core.offload.tier_values import (
    BlockMeta,
    EvictedBlock,
    TickEffects,
    TierEvent,
    TierEventKind,
)
from engined.core.types import Medium

MB = 1_000_000


def key(position: int, seq_hash: int | None = None) -> int:
    """Block `position` of a chain; its sequence hash defaults to 1000 + position."""
    return lineage_key(position, 1000 + position if seq_hash is None else seq_hash)


def parent_key(position: int) -> int | None:
    return key(position - 1) if position else None


def meta(position: int) -> BlockMeta:
    return BlockMeta(
        1000 + position,
        1000 + position - 1 if position else None,
        local_hash=2000 + position,
        token_ids=[4 * position + i for i in range(4)],
    )


def evicted(slot: int, position: int, with_meta: bool = True) -> EvictedBlock:
    return EvictedBlock(
        slot, key(position), parent_key(position), meta(position) if with_meta else None
    )


def seed_config(**overrides: Any) -> OffloadConfig:
    """The seed's `attach_g1_offload_engine` config: 1 MB blocks, 1 GB/s G1->G2, batch 4."""
    fields: dict[str, Any] = {
        "block_size_tokens": 4,
        "block_size_bytes": MB,
        "bandwidth_g1_to_g2_gbps": 1.0,
        "offload_batch_size": 4,
    }
    fields.update(overrides)
    return OffloadConfig(**fields)


def engine(**overrides: Any) -> TierEngine:
    built = TierEngine(seed_config(**overrides))
    built.tick(0.0)
    return built


def described(events: list[TierEvent]) -> list[tuple[str, str, int]]:
    return [(e.kind.value, e.medium.value, e.block.seq_hash) for e in events]


def stored(medium: Medium, *positions: int) -> list[tuple[str, str, int]]:
    return [(TierEventKind.STORED.value, medium.value, 1000 + p) for p in positions]


def removed(medium: Medium, *positions: int) -> list[tuple[str, str, int]]:
    return [(TierEventKind.REMOVED.value, medium.value, 1000 + p) for p in positions]


def summary(effects: TickEffects) -> tuple[object, ...]:
    """Everything a tick reports, as plain values (for determinism comparisons)."""
    return (
        tuple(described(effects.events)),
        tuple(effects.released_g1_slots),
        tuple(effects.completed_onboards),
        tuple((r.onboard_id, tuple(r.slots), tuple(r.pins)) for r in effects.reaped_onboards),
    )
