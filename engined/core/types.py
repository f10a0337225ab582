"""Values that cross the core boundary: requests, commands, results, events, snapshots.

Everything here is a frozen msgspec Struct so the daemon can hand it to an encoder without
copying, and so nothing the core returns can be mutated behind its back. Hot, numerous values
(output signals, KV events) are `gc=False`: they hold no reference cycles, and skipping the
cycle collector matters when a pass emits hundreds of them.
"""

from __future__ import annotations

import enum

import msgspec

RequestId = str
HandoffId = str


class Medium(enum.StrEnum):
    """Storage tier of a KV event, spelled as vLLM spells `medium`."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """A generation request as the core sees it (Dynamo's `DirectRequest`).

    `output_token_ids`, when given, is the planned output: its length overrides `max_tokens`.
    `request_id` is minted by the core when absent.
    """

    token_ids: list[int]
    max_tokens: int
    request_id: RequestId | None = None
    output_token_ids: list[int] | None = None


# --- commands -------------------------------------------------------------------------------


class Submit(msgspec.Struct, frozen=True):
    request: Request


class Cancel(msgspec.Struct, frozen=True):
    request_id: RequestId


class SubmitHandoffPrefill(msgspec.Struct, frozen=True):
    handoff_id: HandoffId
    request: Request


class ReleaseSource(msgspec.Struct, frozen=True):
    handoff_id: HandoffId


class CancelSource(msgspec.Struct, frozen=True):
    handoff_id: HandoffId


class ReserveDestination(msgspec.Struct, frozen=True):
    handoff_id: HandoffId
    request: Request


class ActivateDestination(msgspec.Struct, frozen=True):
    handoff_id: HandoffId


class CancelDestination(msgspec.Struct, frozen=True):
    handoff_id: HandoffId


class SetVocabulary(msgspec.Struct, frozen=True):
    """Change the ids unplanned tokens are drawn from (`EngineArgs.vocab_size` and
    `excluded_token_ids`), e.g. once a Dynamo worker has read its model's tokenizer.

    Contract: validated by the rules `EngineArgs` applies (`vocab_size` in [1, 2**32], every
    excluded id >= 0 and below `vocab_size`, at least one id left drawable); a violation
    raises `InvalidRequestError` naming the field and changes nothing. Otherwise the answer
    is `Applied` and every unplanned token drawn afterwards, in running requests too, follows
    the new setting; tokens already drawn and planned `output_token_ids` are untouched. A
    `vocab_size` of None with no excluded ids restores raw u32 ids. The draws keep using the
    core's seeded RNG, so the same commands at the same points give the same tokens.
    """

    vocab_size: int | None
    excluded_token_ids: tuple[int, ...] = ()


Command = (
    Submit
    | Cancel
    | SubmitHandoffPrefill
    | ReleaseSource
    | CancelSource
    | ReserveDestination
    | ActivateDestination
    | CancelDestination
    | SetVocabulary
)


# --- command results ------------------------------------------------------------------------


class Submitted(msgspec.Struct, frozen=True):
    request_id: RequestId


class DestinationAccepted(msgspec.Struct, frozen=True):
    """The destination is owned; its physical reservation may still be pending."""

    request_id: RequestId


class Applied(msgspec.Struct, frozen=True):
    """The command changed owned state."""


class Noop(msgspec.Struct, frozen=True):
    """The command named nothing this core owns (unknown, or already released)."""


CommandResult = Submitted | DestinationAccepted | Applied | Noop

APPLIED = Applied()
NOOP = Noop()


# --- lifecycle events -----------------------------------------------------------------------


class KvTransferTimingMode(enum.StrEnum):
    FULL_PROMPT = "full_prompt"
    DESTINATION_MISSING = "destination_missing"


class TransferTiming(msgspec.Struct, frozen=True):
    """What a coordinator needs to model the KV transfer of a held source."""

    mode: KvTransferTimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int | None
    bandwidth_gb_s: float | None

    def delay_ms(self, destination_missing_tokens: int) -> float | None:
        """Transfer time for the tokens the mode says must move, or None when unmodelled."""
        tokens = (
            self.full_prompt_tokens
            if self.mode is KvTransferTimingMode.FULL_PROMPT
            else destination_missing_tokens
        )
        if self.kv_bytes_per_token is None or not self.bandwidth_gb_s or self.bandwidth_gb_s <= 0:
            return None
        return tokens * self.kv_bytes_per_token / (self.bandwidth_gb_s * 1e9) * 1000.0


class SourceHeld(msgspec.Struct, frozen=True, tag="source_held", tag_field="kind"):
    """A handoff source finished its prefill; its KV stays allocated until released."""

    handoff_id: HandoffId
    request_id: RequestId
    transfer_timing: TransferTiming


class DestinationReserved(
    msgspec.Struct, frozen=True, tag="destination_reserved", tag_field="kind"
):
    """A destination got its KV blocks; `transferable_prompt_tokens` must be transferred."""

    handoff_id: HandoffId
    request_id: RequestId
    transferable_prompt_tokens: int


LifecycleEvent = SourceHeld | DestinationReserved


class CommandEffects(msgspec.Struct, frozen=True):
    result: CommandResult
    lifecycle_events: list[LifecycleEvent]


# --- pass outputs ---------------------------------------------------------------------------


class OutputSignal(msgspec.Struct, frozen=True, gc=False):
    """One emitted token (or a token-less terminal) of one request.

    `cached_tokens` rides only on a request's first signal (prefix tokens found at its first
    admission); `handoff_delay_ms` only on the terminal signal of a prefill worker.
    """

    request_id: RequestId
    token_id: int | None
    completed: bool
    rejected: bool = False
    handoff_delay_ms: float | None = None
    cached_tokens: int | None = None


class Admission(msgspec.Struct, frozen=True, gc=False):
    """A waiting -> running transition (also re-admission after preemption)."""

    request_id: RequestId
    reused_input_tokens: int


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Blocks became matchable on this rank.

    `block_hashes` are sequence hashes (the router's block identity), `local_hashes` the
    per-block content hashes, `token_ids` the blocks' tokens flattened
    (`len(block_hashes) * block_size` ids). `parent_hash` is the sequence hash of the block
    before the first one, None at the root.
    """

    event_id: int
    dp_rank: int
    parent_hash: int | None
    block_hashes: list[int]
    local_hashes: list[int]
    token_ids: list[int]
    block_size: int
    medium: Medium = Medium.GPU


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks were evicted from `medium` and can no longer be matched there."""

    event_id: int
    dp_rank: int
    block_hashes: list[int]
    medium: Medium = Medium.GPU


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    event_id: int
    dp_rank: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class FpmSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Forward-pass metrics of one pass (Dynamo's `ForwardPassSnapshot`).

    Variances are population variances (Welford). Scheduled prefills are measured over the
    full prompt length, queued decodes over the tokens whose KV they will need.
    """

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0
    num_queued_prefill: int = 0
    sum_queued_prefill_tokens: int = 0
    var_queued_prefill_length: float = 0.0
    num_queued_decode: int = 0
    sum_queued_decode_kv_tokens: int = 0
    var_queued_decode_kv_tokens: float = 0.0
    wall_time_secs: float = 0.0


class EngineMetrics(msgspec.Struct, frozen=True, gc=False):
    """Load gauges of one rank (Dynamo's `MockerMetrics`, plus the inactive pool size)."""

    dp_rank: int
    active_blocks: int
    inactive_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int
    preemptions_total: int
    # Lower tiers (zero without them): G2 host and G3 disk pools, as the G1 fields above.
    g2_active_blocks: int = 0
    g2_inactive_blocks: int = 0
    g2_total_blocks: int = 0
    g3_active_blocks: int = 0
    g3_inactive_blocks: int = 0
    g3_total_blocks: int = 0


class OffloadTickEffects(msgspec.Struct, frozen=True):
    """What advancing the offload tiers between passes produced (`VllmCore.tick_offload_only`).

    `kv_events` are every KV event buffered since the last pass, the tick's lower-tier
    Stored/Removed and swap-in GPU Stored included; publish them like a pass's.
    """

    kv_events: list[KvEvent]
    lifecycle_events: list[LifecycleEvent]


class PassResult(msgspec.Struct, frozen=True):
    """Everything one engine pass produced; the daemon publishes it, the core forgets it."""

    # Modeled end of the pass; the daemon paces to it and stamps outputs with it.
    end_ms: float
    # Requests that left the core this pass (completed, rejected or dropped).
    completed_requests: int
    # Per-token outputs in emission order; the daemon groups them per client.
    output_signals: list[OutputSignal]
    # Waiting -> running transitions, for tracing and TTFT accounting.
    admissions: list[Admission]
    # Handoff events produced by this pass (source holds).
    lifecycle_events: list[LifecycleEvent]
    # Gauges after the pass; the stats reply and Prometheus read them.
    metrics: EngineMetrics
    # KV events in the order they happened; published at pass start (vLLM visibility).
    kv_events: list[KvEvent]
    # Forward-pass metrics of this pass.
    fpm: FpmSnapshot
    # Prompt tokens looked up in the prefix cache by this pass's admissions, and those found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # MTP acceptance: visible output tokens and the decode forwards that produced them.
    accept_length_output_tokens: int = 0
    accept_length_decode_forwards: int = 0
