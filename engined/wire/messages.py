"""Control protocol v1: the message structs of the daemon's ROUTER socket.

Client -> daemon messages are one tagged union (`"type"`, snake_case) of strict structs:
unknown keys are refused so typos surface, and msgspec checks types and value ranges while
decoding. Daemon -> client messages tolerate unknown keys when decoded, so a client keeps
working when a later daemon adds fields (msgspec's schema evolution rules). The codecs, and
the rules msgspec's constraints cannot express, are in `engined.wire.control`, which also
re-exports every name here: import messages from there.
"""

from __future__ import annotations

from typing import Final, Literal, TypeAlias, get_args

import msgspec

from engined.core.args import EngineType, WorkerType

# The core's own timing record is the protocol's `transfer_timing` (one definition).
from engined.core.transfer_timing import KvTransferTimingMode as KvTransferTimingMode
from engined.core.transfer_timing import TransferTiming as TransferTiming
from engined.wire.constraints import (
    AcceptStr,
    CacheSalt,
    DpRank,
    HandoffIdStr,
    MessageId,
    NonNegativeInt,
    PromptTokenIds,
    RequestIdStr,
    RequestPriority,
    RequestSeed,
    StopTokenIds,
    TokenId,
    VocabSize,
    WorkerIdStr,
)
from engined.wire.protocol_errors import ErrorCode

PROTOCOL_VERSION: Final = 1
REQUEST_ID_MAX_BYTES: Final = 256
HANDOFF_ID_MAX_BYTES: Final = 256
MESSAGE_ID_MAX_BYTES: Final = 128
WORKER_ID_MAX_BYTES: Final = 256

FinishReason: TypeAlias = Literal["length", "rejected", "cancelled", "stop"]

# --- client -> daemon -----------------------------------------------------------------------


class WireRequest(
    msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True, frozen=True
):
    """The `request` map of `submit`, `submit_handoff_prefill` and `reserve_destination`.

    `request_id` is minted by the core when absent; `output_token_ids`, when given, is the
    planned output and its length overrides `max_tokens` (0 = prefill only); `dp_rank` pins
    the rank, else the daemon picks one round-robin; `seed` keys the generated tokens as
    vLLM's `SamplingParams.seed` does (engined/core/token_stream.py); `priority` orders it
    under `scheduling_policy = priority` as vLLM's request priority does (lower first).
    `stop_token_ids`, `min_tokens` (at most the output's length) and `cache_salt` are vLLM's
    `SamplingParams` fields and request salt, with vLLM's semantics (PROTOCOL.md §1.1).
    """

    request_id: RequestIdStr | None = None
    token_ids: PromptTokenIds
    max_tokens: NonNegativeInt
    output_token_ids: list[TokenId] | None = None
    dp_rank: DpRank | None = None
    seed: RequestSeed | None = None
    priority: RequestPriority = 0
    stop_token_ids: StopTokenIds | None = None
    min_tokens: NonNegativeInt = 0
    cache_salt: CacheSalt | None = None


class ClientMessageBase(
    msgspec.Struct,
    tag_field="type",
    forbid_unknown_fields=True,
    kw_only=True,
    omit_defaults=True,
):
    """Base of every client message; `id` is copied into the direct reply."""

    # NOTE: not frozen: mypy would then demand `frozen=True` restated on every subclass.

    id: MessageId | None = None


class Hello(ClientMessageBase, tag="hello"):
    pass


class Submit(ClientMessageBase, tag="submit"):
    request: WireRequest


class Cancel(ClientMessageBase, tag="cancel"):
    request_id: RequestIdStr


class SubmitHandoffPrefill(ClientMessageBase, tag="submit_handoff_prefill"):
    handoff_id: HandoffIdStr
    request: WireRequest


class ReleaseSource(ClientMessageBase, tag="release_source"):
    handoff_id: HandoffIdStr


class CancelSource(ClientMessageBase, tag="cancel_source"):
    handoff_id: HandoffIdStr


class ReserveDestination(ClientMessageBase, tag="reserve_destination"):
    handoff_id: HandoffIdStr
    request: WireRequest


class ActivateDestination(ClientMessageBase, tag="activate_destination"):
    handoff_id: HandoffIdStr


class CancelDestination(ClientMessageBase, tag="cancel_destination"):
    handoff_id: HandoffIdStr


class Stats(ClientMessageBase, tag="stats"):
    pass


class ResetPrefixCache(ClientMessageBase, tag="reset_prefix_cache"):
    """Clear the prefix cache of `dp_rank`, or of every rank when absent."""

    dp_rank: DpRank | None = None


class Ping(ClientMessageBase, tag="ping"):
    pass


class WaitIdle(ClientMessageBase, tag="wait_idle"):
    """Answer (a `stats` reply) once `dp_rank`, or every rank when absent, is idle.

    Idle: nothing queued, running or parked, and every command the daemon received before
    this message applied and its outputs sent. Tests and benchmarks that wait for a workload
    to finish then need no `stats` polling loop.
    """

    dp_rank: DpRank | None = None


class SetVocabulary(ClientMessageBase, tag="set_vocabulary"):
    """Draw generated ids from `[0, vocab_size)` without `excluded_token_ids`, on every rank.

    A front end that detokenizes (Dynamo's) needs ids its tokenizer knows, and outputs that
    never hit its EOS; `vocab_size` nil restores random u32 ids. Affects tokens drawn after it.
    """

    vocab_size: VocabSize | None
    excluded_token_ids: list[TokenId] = msgspec.field(default_factory=list)


class SetFpmWorkerId(ClientMessageBase, tag="set_fpm_worker_id"):
    """Stamp the forward-pass metrics of `dp_rank`, or of every rank when absent, with
    `worker_id` from now on.

    Dynamo's planner joins FPM with the worker that relays it by this id, which only the
    worker knows (its endpoint's connection id), so the worker tells the daemon. A worker that
    registers each rank as a Dynamo worker of its own has one id per rank.
    """

    worker_id: WorkerIdStr
    dp_rank: DpRank | None = None


class WatchLoad(ClientMessageBase, tag="watch_load"):
    """Stream `load` messages to this client: one per rank now, then one whenever it changes.

    A KV router needs each rank's used blocks as they change; pushing them after the pass
    that changed them is both prompter and cheaper than polling `stats`.
    """


class Metrics(ClientMessageBase, tag="metrics"):
    """The daemon's Prometheus exposition, as its `/metrics` serves it for this `Accept` header
    (absent: the text format), so that an API server serves `/metrics` on its own port."""

    accept: AcceptStr | None = None


ClientMessage: TypeAlias = (
    Hello
    | Submit
    | Cancel
    | SubmitHandoffPrefill
    | ReleaseSource
    | CancelSource
    | ReserveDestination
    | ActivateDestination
    | CancelDestination
    | Stats
    | ResetPrefixCache
    | Ping
    | WaitIdle
    | SetVocabulary
    | SetFpmWorkerId
    | WatchLoad
    | Metrics
)

# The `type` tags of every client message, in declaration order (fuzzers, docs and tests).
CLIENT_MESSAGE_TAGS: Final = tuple(str(c.__struct_config__.tag) for c in get_args(ClientMessage))

# --- daemon -> client -----------------------------------------------------------------------


class DaemonMessageBase(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every daemon message; fields equal to their default (None) are left out."""


class DirectReply(DaemonMessageBase, kw_only=True):
    """A reply to one client message, echoing its `id` when it had one."""

    # NOTE: `kw_only` is restated because mypy applies it per declaring class: without it,
    # mypy reads `id` as positional and refuses the required fields subclasses add after it.

    id: MessageId | None = None


class Welcome(DirectReply, tag="welcome"):
    """What a client needs to find every socket; endpoint lists have one entry per rank.

    `kv_replay_endpoints` is empty when replay is disabled; `protocol` is `PROTOCOL_VERSION`.
    """

    protocol: int
    version: str
    engine_type: EngineType
    worker_type: WorkerType
    block_size: int
    num_gpu_blocks: int
    dp_size: int
    model_name: str
    kv_events_endpoints: list[str]
    kv_replay_endpoints: list[str]
    fpm_endpoints: list[str]
    # Added later in v1 (older clients ignore them): what a front end registering the
    # engine needs (Dynamo's model card), and the current vocabulary and FPM worker id.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    kv_events_topic: str | None = None
    kv_events_format: str | None = None
    vocab_size: int | None = None
    excluded_token_ids: list[int] | None = None
    fpm_worker_id: str | None = None
    # Wall time = modeled time / speedup_ratio (0: as fast as possible); a coordinator that
    # waits out a modeled KV transfer needs it.
    speedup_ratio: float | None = None
    # Where a peer running as the daemon's user connects to act as operator (engine-wide
    # commands); None when there is no such endpoint (protocol §1.5).
    operator_endpoint: str | None = None
    # Drawn at each daemon start: a client that reconnects and reads another one knows the
    # daemon restarted and lost its requests, vocabulary and FPM worker id.
    instance_id: str | None = None


class Submitted(DirectReply, tag="submitted"):
    request_id: str
    dp_rank: int


class DestinationAccepted(DirectReply, tag="destination_accepted"):
    """The destination is owned; its KV reservation may still be pending (see `lifecycle`)."""

    request_id: str
    dp_rank: int


class Applied(DirectReply, tag="applied"):
    pass


class Noop(DirectReply, tag="noop"):
    """The command named nothing the daemon owns (unknown, or already released)."""


class RankStats(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    dp_rank: int
    active_blocks: int
    inactive_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int
    preemptions_total: int
    passes_total: int
    # How late passes started against their modeled deadlines (paced mode; 0 otherwise),
    # over the last 100,000 passes.
    lateness_p50_ms: float = 0.0
    lateness_p99_ms: float = 0.0
    lateness_max_ms: float = 0.0
    # Offload tiers (0 without them): the G2 host and G3 disk pools, as the GPU fields above.
    g2_active_blocks: int = 0
    g2_inactive_blocks: int = 0
    g2_total_blocks: int = 0
    g3_active_blocks: int = 0
    g3_inactive_blocks: int = 0
    g3_total_blocks: int = 0
    # KV event messages a slow subscriber missed because its byte budget was full
    # (`kv_events_buffer_bytes`); also `engined:kv_events_overflows_total`.
    kv_events_overflows: int = 0


class StatsReply(DirectReply, tag="stats"):
    ranks: list[RankStats]


class Pong(DirectReply, tag="pong"):
    """`instance_id` is the welcome's (added later in v1), so a ping alone tells a restart."""

    instance_id: str | None = None


class ErrorReply(DirectReply, tag="error"):
    code: ErrorCode
    message: str


class OutputEntry(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True, gc=False):
    """What one request emitted in one pass (all tokens of a speculative burst together).

    `finish_reason` is null until the request's last entry; `cached_tokens` rides only on a
    request's first entry, `handoff_delay_ms` only on a prefill worker's last one, and
    `stop_reason` (the stop id it generated, vLLM's `stop_reason`) only on the last entry of
    a request that finished `"stop"`.
    """

    # NOTE: `finish_reason` has no default so omit_defaults still sends it as null.

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int | None = None
    handoff_delay_ms: float | None = None
    stop_reason: int | None = None


class Output(DaemonMessageBase, tag="output", gc=False):
    """At most one per client per engine pass."""

    dp_rank: int
    outputs: list[OutputEntry]


class SourceHeldEvent(msgspec.Struct, tag_field="kind", tag="source_held", frozen=True):
    handoff_id: str
    request_id: str
    # Added in protocol v1 without a version change; absent (null) from older daemons.
    transfer_timing: TransferTiming | None = None


class DestinationReservedEvent(
    msgspec.Struct, tag_field="kind", tag="destination_reserved", frozen=True
):
    handoff_id: str
    request_id: str
    transferable_prompt_tokens: int


WireLifecycleEvent: TypeAlias = SourceHeldEvent | DestinationReservedEvent


class Load(DaemonMessageBase, tag="load", gc=False):
    """A rank's KV load, streamed to `watch_load` clients after a pass or command changed it."""

    dp_rank: int
    active_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int


class MetricsReply(DirectReply, tag="metrics"):
    """The exposition `/metrics` would answer now: its Content-Type and its body."""

    content_type: str
    text: str


class Lifecycle(DaemonMessageBase, tag="lifecycle"):
    dp_rank: int
    events: list[WireLifecycleEvent]


DaemonMessage: TypeAlias = (
    Welcome
    | Submitted
    | DestinationAccepted
    | Applied
    | Noop
    | StatsReply
    | Pong
    | ErrorReply
    | Output
    | Lifecycle
    | Load
    | MetricsReply
)
