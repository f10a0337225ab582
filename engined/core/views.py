"""Read-only snapshots of an engine's state, for tests and tools (`Engine.inspect`...).

Each is a copy taken when asked, never a live view: holding one changes nothing and it
never changes afterwards.
"""

from __future__ import annotations

import enum

import msgspec

from engined.core.types import HandoffId, OffloadWait, RequestId, RequestStatus


class RequestPlace(enum.StrEnum):
    """Which table of the engine holds a request."""

    WAITING = "waiting"  # the waiting queue (fresh, preempted or an activated destination)
    RUNNING = "running"
    PARKED = "parked"  # off the queue while its prefix is onboarded from G2/G3
    PENDING_DESTINATION = "pending_destination"  # a destination waiting for KV
    RESERVED_DESTINATION = "reserved_destination"  # a destination holding KV, not activated


class RequestView(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the engine holds it now (`Engine.inspect`); a copy, never live."""

    request_id: RequestId
    place: RequestPlace
    status: RequestStatus
    prompt_tokens: int
    # Prompt plus the tokens generated so far.
    num_tokens: int
    output_tokens: int
    max_output_tokens: int
    num_computed_tokens: int
    num_allocated_tokens: int
    num_preemptions: int
    cached_prefix_tokens: int | None
    offload_wait: OffloadWait | None
    # G1 block ids the request holds, full blocks first (then its partial block).
    block_ids: list[int]
    # Its full blocks: sequence hashes, and lineage keys with their parents (the block
    # pool's identity of a block, the same in every tier).
    block_hashes: list[int]
    block_keys: list[int]
    block_parent_keys: list[int | None]


class SourceStage(enum.Enum):
    """A handoff source on a prefill engine (mocker-protocols.md §1.9)."""

    PENDING = "pending"  # registered; its request is queued or running
    HELD = "held"  # its request finished; the KV is held until released


class DestinationStage(enum.Enum):
    """A handoff destination on a decode engine (mocker-protocols.md §1.9)."""

    PENDING = "pending"  # waiting in the FIFO for KV
    RESERVED = "reserved"  # KV reserved, not activated
    ACTIVE = "active"  # activated; its request runs here


class HandoffView(msgspec.Struct, frozen=True, kw_only=True):
    """One handoff as this engine holds it (`Engine.inspect_handoff`).

    An engine is normally one side of a handoff; nothing stops a caller from using one id
    on both sides of the same engine, so each side is reported on its own.
    """

    handoff_id: HandoffId
    source: SourceStage | None
    source_request_id: RequestId | None
    destination: DestinationStage | None
    destination_request_id: RequestId | None
    # G1 blocks reserved for a reserved destination (empty otherwise).
    reserved_block_ids: list[int]


class QueueView(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's queues in order (`Engine.queues`)."""

    waiting: list[RequestId]
    running: list[RequestId]
    parked: list[RequestId]
    pending_destinations: list[HandoffId]
