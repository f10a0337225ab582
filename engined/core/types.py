"""Values that cross the core boundary: requests, commands, results, events, snapshots.

Everything here is a frozen msgspec Struct so the daemon can hand it to an encoder without
copying, and so nothing the core returns can be mutated behind its back. Hot, numerous values
(request outputs, KV events) are `gc=False`: they hold no reference cycles, and skipping the
cycle collector matters when a pass emits hundreds of them.

The shapes follow vLLM's v1 engine (`vllm/v1/engine/__init__.py`): a pass yields one
`RequestOutput` per request that progressed (its new token ids, a `FinishReason` once it
ends), its plain decode steps column-wise (`Decodes`, as the model runner's output holds
them), and every call says which requests ended and why (`EndedRequest`). Read-only
snapshots of the engine's state are in views.py.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import msgspec

from engined.core.block_events import AllBlocksCleared as AllBlocksCleared
from engined.core.block_events import BlockRemoved as BlockRemoved
from engined.core.block_events import BlockStored as BlockStored
from engined.core.block_events import KvEvent as KvEvent
from engined.core.block_events import Medium as Medium
from engined.core.gauges import EngineMetrics as EngineMetrics
from engined.core.gauges import FpmSnapshot as FpmSnapshot
from engined.core.kv_residency import KvBlockEviction
from engined.core.pass_trace import PassTrace
from engined.core.pause_types import Pause as Pause
from engined.core.pause_types import PauseMode as PauseMode
from engined.core.pause_types import ReleaseKvCacheMemory as ReleaseKvCacheMemory
from engined.core.pause_types import ResetPrefixCache as ResetPrefixCache
from engined.core.pause_types import Resume as Resume
from engined.core.pause_types import Sleep as Sleep
from engined.core.pause_types import WakeUp as WakeUp

# NOTE: re-exported: the transfer timing model is part of the lifecycle events below.
from engined.core.transfer_timing import KvTransferTimingMode as KvTransferTimingMode
from engined.core.transfer_timing import TransferTiming as TransferTiming
from engined.core.transfer_timing import kv_transfer_ms as kv_transfer_ms

RequestId = str
HandoffId = str


class RequestStatus(enum.Enum):
    """Where a request stands in the scheduler (vLLM's `RequestStatus`, the states it has here)."""

    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"


class FinishReason(enum.StrEnum):
    """Why a request ended, spelled as the control protocol spells `finish_reason`.

    `LENGTH`: it produced its `max_tokens` (or reached `max_model_len`), vLLM's "length".
    `REJECTED`: admission refused it (it could never run here). `CANCELLED`: a command
    dropped it (cancel, cancel_source of a pending source, cancel_destination).
    """

    LENGTH = "length"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    STOP = "stop"  # one of its stop_token_ids came out past min_tokens: vLLM's "stop"


class OffloadWait(NamedTuple):
    """An allocation waiting on an offload (upstream `BlockedOnOffload`): evicted blocks are
    still being copied out of G1, so the request keeps it (refreshed at each retry) instead of
    preempting. `deadline_ms`: the earliest completion on the G1->G2 link, upstream's wake-up
    (None for a transfer without bytes). engined/core/offload/__init__.py has the glossary."""

    lease_id: int
    deadline_ms: float | None


class LoraRequest(msgspec.Struct, frozen=True, gc=False):
    """The LoRA adapter a request runs with, vLLM's `LoRARequest` (the fields it schedules
    and hashes by): `lora_int_id` (at least 1) is what `max_loras` counts and KV events call
    `lora_id`; `lora_name` and `lora_path` key the request's blocks apart from the base
    model's and from other adapters' (re-pointing a name at another path shares nothing)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """A generation request as the core sees it (Dynamo's `DirectRequest`).

    `output_token_ids`, when given, is the planned output: its length overrides `max_tokens`.
    `request_id` is minted by the core when absent. `seed` keys the request's token stream as
    vLLM's `SamplingParams.seed` does (engined/core/token_stream.py); without one the stream
    is keyed by `stream_name`, or the request id when that is None. The daemon sets it so
    that neither the alias it runs a request under nor the UUID it names an unnamed one with
    changes the tokens: the client's own name, or the count of unnamed requests before it."""

    token_ids: list[int]
    max_tokens: int
    request_id: RequestId | None = None
    output_token_ids: list[int] | None = None
    seed: int | None = None
    stream_name: str | int | None = None
    # vLLM's request priority: lower runs first under `scheduling_policy = priority`.
    priority: int = 0
    # vLLM's `stop_token_ids`, `min_tokens` (engined/core/stops.py) and `cache_salt`.
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    cache_salt: str | None = None
    # vLLM's `lora_request`: accepted with `enable_lora` only (vLLM semantics).
    lora_request: LoraRequest | None = None
    # vLLM's `kv_cache_report_mode`: "full" (vLLM semantics) stores a prefix hit again.
    kv_cache_report_mode: str = "incremental"


# --- commands -------------------------------------------------------------------------------
# Commands and their results are tagged (`{"type": "Submit", ...}`) so that their unions
# decode as they are: a rank worker process receives and answers them in these very types.


class Submit(msgspec.Struct, frozen=True, tag=True):
    request: Request


class Cancel(msgspec.Struct, frozen=True, tag=True):
    request_id: RequestId


class SubmitHandoffPrefill(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId
    request: Request


class ReleaseSource(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId


class CancelSource(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId


class ReserveDestination(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId
    request: Request


class ActivateDestination(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId


class CancelDestination(msgspec.Struct, frozen=True, tag=True):
    handoff_id: HandoffId


class SetVocabulary(msgspec.Struct, frozen=True, tag=True):
    """Change the ids unplanned tokens are drawn from (`EngineArgs.vocab_size` and
    `excluded_token_ids`), e.g. once a Dynamo worker has read its model's tokenizer.

    Contract: validated by the rules `EngineArgs` applies (`vocab_size` in [1, 2**32], at most
    `EXCLUDED_TOKEN_IDS_MAX` excluded ids, every one >= 0 and below `vocab_size`, at least one
    id left drawable); a violation raises `InvalidRequestError` naming the field and changes
    nothing. Otherwise the answer is `Applied` and every unplanned token drawn afterwards, in
    running requests too, follows the new setting; tokens already drawn and planned
    `output_token_ids` are untouched. A `vocab_size` of None with no excluded ids restores raw
    u32 ids. The draws keep using the core's seeded RNG, so the same commands at the same
    points give the same tokens.
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
    | ResetPrefixCache
    | Pause
    | Resume
    | Sleep
    | WakeUp
    | ReleaseKvCacheMemory
)


# --- command results ------------------------------------------------------------------------


class Submitted(msgspec.Struct, frozen=True, tag=True):
    request_id: RequestId


class DestinationAccepted(msgspec.Struct, frozen=True, tag=True):
    """The destination is owned; its physical reservation may still be pending."""

    request_id: RequestId


class Applied(msgspec.Struct, frozen=True, tag=True):
    """The command changed owned state."""


class Noop(msgspec.Struct, frozen=True, tag=True):
    """The command named nothing this core owns (unknown, or already released)."""


class Refused(msgspec.Struct, frozen=True, tag=True):
    """The command could not be carried out now and changed nothing (`reason` says why)."""

    reason: str


CommandResult = Submitted | DestinationAccepted | Applied | Noop | Refused

APPLIED = Applied()
NOOP = Noop()


# --- lifecycle events -----------------------------------------------------------------------


class SourceHeld(msgspec.Struct, frozen=True, tag="source_held", tag_field="kind"):
    """A handoff source finished its prefill; its KV stays allocated until released."""

    handoff_id: HandoffId
    request_id: RequestId
    transfer_timing: TransferTiming

    def transfer_delay_ms(self, reserved: DestinationReserved) -> float | None:
        """The KV transfer time of this handoff once its destination `reserved` its KV.

        What upstream's coordinator issues as `StartTransfer{delay_ms}`: the source's
        timing applied to the destination's `transferable_prompt_tokens`
        (`kv_transfer_timing_mode` decides whether those or the full prompt move).
        """
        return self.transfer_timing.delay_ms(reserved.transferable_prompt_tokens)


class DestinationReserved(
    msgspec.Struct, frozen=True, tag="destination_reserved", tag_field="kind"
):
    """A destination got its KV blocks; `transferable_prompt_tokens` must be transferred."""

    handoff_id: HandoffId
    request_id: RequestId
    transferable_prompt_tokens: int


LifecycleEvent = SourceHeld | DestinationReserved


class EndedRequest(msgspec.Struct, frozen=True, gc=False):
    """A request that left the core, and why. Its KV is freed (or held, for a source)."""

    request_id: RequestId
    reason: FinishReason


# --- pass outputs ---------------------------------------------------------------------------


class RequestOutput(msgspec.Struct, frozen=True, gc=False):
    """What one request produced in one pass (vLLM's `EngineCoreOutput`).

    `new_token_ids`: this pass's tokens (one, an MTP burst, or none); `finish_reason` on the
    last output. `cached_tokens` only on the first (the prefix hit at its first admission);
    `handoff_delay_ms` on a prefill worker's last (the modeled transfer of its prompt).
    """

    request_id: RequestId
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    cached_tokens: int | None = None
    handoff_delay_ms: float | None = None
    stop_reason: int | None = None  # the stop id, on the last output of a stopped request


class Decodes(msgspec.Struct, frozen=True, gc=False):
    """A pass's plain decode steps, column-wise: `request_ids[i]` produced the one token
    `token_ids[i]`, is not finished and has no cached tokens to report.

    Nearly every output of a decoding engine is one of these; a `RequestOutput` each was the
    largest per-token cost of a steady pass. So they are columns, as vLLM's model runner
    reports sampled tokens, and only the daemon's routing makes per-request entries of them.
    `before[i]`: how many came before the pass's `outputs[i]` (emission order, `in_order`).
    """

    request_ids: list[RequestId] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    before: list[int] = msgspec.field(default_factory=list)

    def in_order(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` and these steps as one list of `RequestOutput`s, in emission order (for
        tests and tools, not the hot path)."""
        steps = [
            RequestOutput(r, [t]) for r, t in zip(self.request_ids, self.token_ids, strict=True)
        ]
        merged: list[RequestOutput] = []
        taken = 0
        for output, before in zip(outputs, self.before, strict=True):
            merged += steps[taken:before]
            taken = before
            merged.append(output)
        merged += steps[taken:]
        return merged


class CommandEffects(msgspec.Struct, frozen=True):
    """What applying one command did.

    `lifecycle_events` are the handoff events it caused (a destination reserved, by the
    command itself or by the pending-destination retry that follows every command);
    `ended` the requests it dropped; `kv_events` the KV events it caused (publish them like
    a pass's); `progressed` whether it changed anything at all.
    """

    result: CommandResult
    lifecycle_events: list[LifecycleEvent]
    ended: list[EndedRequest] = []
    kv_events: list[KvEvent] = []
    progressed: bool = True


class Admission(msgspec.Struct, frozen=True, gc=False):
    """A waiting -> running transition (also re-admission after preemption)."""

    request_id: RequestId
    reused_input_tokens: int


class TierAdvance(msgspec.Struct, frozen=True):
    """What advancing the offload tiers between passes produced (`Engine.advance_tiers`).

    `kv_events` are the tick's lower-tier Stored/Removed and onboarding GPU Stored; publish
    them like a pass's. `lifecycle_events` the destination the retry that follows reserved.
    """

    kv_events: list[KvEvent]
    lifecycle_events: list[LifecycleEvent]

    @property
    def progressed(self) -> bool:
        return bool(self.kv_events or self.lifecycle_events)


class PassResult(msgspec.Struct, frozen=True):
    """Everything one engine pass produced; the daemon publishes it, the core forgets it."""

    # Modeled end of the pass; the daemon paces to it and stamps outputs with it.
    end_ms: float
    # One output per request that produced tokens or ended, in emission order, but for the
    # plain decode steps, which are in `decodes`; `request_outputs()` merges the two.
    outputs: list[RequestOutput]
    # The plain decode steps (one token, unfinished, no cached tokens to report), with
    # `before` giving each of `outputs` its place among them.
    decodes: Decodes
    # Requests that left the core this pass (finished, rejected), and why.
    ended: list[EndedRequest]
    # Waiting -> running transitions, for tracing and TTFT accounting.
    admissions: list[Admission]
    # Handoff events of this pass: source holds, then the reservation its retry made.
    lifecycle_events: list[LifecycleEvent]
    # Gauges after the pass; the stats reply and Prometheus read them.
    metrics: EngineMetrics
    # KV events in the order they happened; published at pass start (vLLM visibility).
    kv_events: list[KvEvent]
    # Forward-pass metrics of this pass.
    fpm: FpmSnapshot
    # Whether the pass changed anything; one that did not waits for the next command.
    progressed: bool = True
    # Prompt tokens looked up in the prefix cache by this pass's admissions, and those found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Visible output tokens and the decode forwards (MTP bursts) that produced them.
    accept_length_output_tokens: int = 0
    accept_length_decode_forwards: int = 0
    trace: PassTrace | None = None  # only with `record=True` (engined/core/pass_trace.py)
    # Sampled blocks whose slots were reused since the last pass (`kv_cache_metrics` only).
    kv_block_evictions: list[KvBlockEviction] = []
    # MTP, vLLM's `SpecDecodingStats` of the pass: requests that verified drafts, the drafts
    # they verified, those accepted, and per draft position the drafts accepted there.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []

    def request_outputs(self) -> list[RequestOutput]:
        """Every request's output of this pass, `outputs` and `decodes` in emission order.
        For tests and tools; the daemon routes the two without merging them."""
        return self.decodes.in_order(self.outputs)
