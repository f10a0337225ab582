"""Control protocol v1: the message structs of the daemon's ROUTER socket.

Client -> daemon messages are one tagged union (`"type"`, snake_case) of strict structs:
unknown keys are refused so typos surface, and msgspec checks types and value ranges while
decoding. Daemon -> client messages tolerate unknown keys when decoded, so a client keeps
working when a later daemon adds fields (msgspec's schema evolution rules). The codecs, and
the rules msgspec's constraints cannot express, are in `engined.wire.control`, which also
re-exports every name here: import messages from there. The client -> daemon half is declared
in `engined.wire.client_messages` (re-exported here), so each half reads on its own.
"""

from __future__ import annotations

from typing import Final, Literal, TypeAlias

import msgspec

from engined.core.args import EngineType, WorkerType

# The core's own timing record is the protocol's `transfer_timing` (one definition).
from engined.core.transfer_timing import KvTransferTimingMode as KvTransferTimingMode
from engined.core.transfer_timing import TransferTiming as TransferTiming
from engined.wire.client_messages import (
    CLIENT_MESSAGE_TAGS as CLIENT_MESSAGE_TAGS,
)
from engined.wire.client_messages import (
    OPERATOR_ONLY as OPERATOR_ONLY,
)
from engined.wire.client_messages import (
    ActivateDestination as ActivateDestination,
)
from engined.wire.client_messages import (
    Cancel as Cancel,
)
from engined.wire.client_messages import (
    CancelDestination as CancelDestination,
)
from engined.wire.client_messages import (
    CancelSource as CancelSource,
)
from engined.wire.client_messages import (
    ClientMessage as ClientMessage,
)
from engined.wire.client_messages import (
    ClientMessageBase as ClientMessageBase,
)
from engined.wire.client_messages import (
    Hello as Hello,
)
from engined.wire.client_messages import (
    Metrics as Metrics,
)
from engined.wire.client_messages import (
    Pause as Pause,
)
from engined.wire.client_messages import (
    Ping as Ping,
)
from engined.wire.client_messages import (
    ReleaseKvCacheMemory as ReleaseKvCacheMemory,
)
from engined.wire.client_messages import (
    ReleaseSource as ReleaseSource,
)
from engined.wire.client_messages import (
    ReserveDestination as ReserveDestination,
)
from engined.wire.client_messages import (
    ResetPrefixCache as ResetPrefixCache,
)
from engined.wire.client_messages import (
    Resume as Resume,
)
from engined.wire.client_messages import (
    SetFpmWorkerId as SetFpmWorkerId,
)
from engined.wire.client_messages import (
    SetVocabulary as SetVocabulary,
)
from engined.wire.client_messages import (
    SetWeightVersion as SetWeightVersion,
)
from engined.wire.client_messages import (
    Sleep as Sleep,
)
from engined.wire.client_messages import (
    Stats as Stats,
)
from engined.wire.client_messages import (
    Submit as Submit,
)
from engined.wire.client_messages import (
    SubmitHandoffPrefill as SubmitHandoffPrefill,
)
from engined.wire.client_messages import (
    WaitIdle as WaitIdle,
)
from engined.wire.client_messages import (
    WakeUp as WakeUp,
)
from engined.wire.client_messages import (
    WatchLoad as WatchLoad,
)

# Re-exported: the client -> daemon half is declared in `engined.wire.client_messages`.
from engined.wire.client_messages import (
    WireLoraRequest as WireLoraRequest,
)
from engined.wire.client_messages import (
    WireRequest as WireRequest,
)
from engined.wire.constraints import (
    MessageId,
)
from engined.wire.protocol_errors import ErrorCode

PROTOCOL_VERSION: Final = 1
REQUEST_ID_MAX_BYTES: Final = 256
HANDOFF_ID_MAX_BYTES: Final = 256
MESSAGE_ID_MAX_BYTES: Final = 128
WORKER_ID_MAX_BYTES: Final = 256
# vLLM's weight version until one is set (EngineCore's `_weight_version`); output entries
# leave it out.
DEFAULT_WEIGHT_VERSION: Final = "default"

FinishReason: TypeAlias = Literal["length", "rejected", "cancelled", "stop"]

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
    # vLLM's pause and sleep (`pause`, `sleep`): the scheduler's PauseState (0 unpaused,
    # 1 PAUSED_NEW, 2 PAUSED_ALL), whether a pause still waits for the rank to go idle,
    # whether new requests are refused (`paused`), the sleeping pools, and the sleep state
    # vLLM records (`asleep`, `sleep_level`), as the core's gauges of those names.
    pause_state: int = 0
    pause_pending: bool = False
    rejecting: bool = False
    sleeping_tags: tuple[str, ...] = ()
    asleep: bool = False
    sleep_level: int = 0
    # vLLM's `get_weight_version()`: the label the rank's outputs carry (`set_weight_version`).
    weight_version: str = DEFAULT_WEIGHT_VERSION


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
    # The weight version that sampled the entry's tokens (`set_weight_version`; added later
    # in v1), absent for vLLM's "default".
    weight_version: str | None = None


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
