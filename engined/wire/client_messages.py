"""Control protocol v1, client -> daemon: the request and every message a client sends.

One tagged union (`"type"`, snake_case) of strict structs: unknown keys are refused so typos
surface, and msgspec checks types and value ranges while decoding. Declared apart from the
daemon's replies (`engined.wire.messages`, which re-exports these, as `engined.wire.control`
does) because the two halves follow opposite rules for unknown keys.
"""

from __future__ import annotations

from typing import Final, TypeAlias, get_args

import msgspec

from engined.wire.constraints import (
    AcceptStr,
    CacheSalt,
    DpRank,
    HandoffIdStr,
    KvCacheReportMode,
    LoraIntId,
    LoraName,
    LoraPath,
    MessageId,
    NonNegativeInt,
    PauseModeStr,
    PromptTokenIds,
    RequestIdStr,
    RequestPriority,
    RequestSeed,
    SleepLevel,
    StopTokenIds,
    TokenId,
    VocabSize,
    WakeUpTags,
    WeightVersionStr,
    WorkerIdStr,
)


class WireLoraRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The `lora_request` of a request: vLLM's `LoRARequest`, the fields it schedules and
    hashes by (PROTOCOL.md §1.1); the daemon needs `engine.enable_lora`."""

    lora_name: LoraName
    lora_int_id: LoraIntId
    lora_path: LoraPath


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
    `SamplingParams` fields and request salt, with vLLM's semantics (PROTOCOL.md §1.1);
    `lora_request` the LoRA adapter it runs with, vLLM's; `kv_cache_report_mode` "full",
    as vLLM's `extra_args` key, publishes each of its prefix hits again as BlockStored.
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
    lora_request: WireLoraRequest | None = None
    kv_cache_report_mode: KvCacheReportMode = "incremental"


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
    """Clear the prefix cache of `dp_rank`, or of every rank when absent; with
    `reset_running_requests` (vLLM's), preempt the running requests first."""

    dp_rank: DpRank | None = None
    reset_running_requests: bool = False


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


class Pause(ClientMessageBase, tag="pause"):
    """vLLM's `pause_generation(mode, clear_cache)` on every rank (its DP client pauses every
    engine); answered (`stats`) once every rank's pause has completed, as vLLM's call returns.
    Operators only: it stops everyone's generation."""

    mode: PauseModeStr = "abort"
    clear_cache: bool = True


class Resume(ClientMessageBase, tag="resume"):
    """vLLM's `resume_generation` on every rank; answered with `stats`. Operators only."""


class Sleep(ClientMessageBase, tag="sleep"):
    """vLLM's `sleep(level, mode)` on every rank; answered (`stats`) once every rank sleeps.
    Operators only."""

    level: SleepLevel = 1
    mode: PauseModeStr = "abort"


class WakeUp(ClientMessageBase, tag="wake_up"):
    """vLLM's `wake_up(tags)` on every rank (nil: every pool); answered with `stats`, whose
    `asleep` says whether every rank is fully awake. Operators only."""

    tags: WakeUpTags | None = None


class SetWeightVersion(ClientMessageBase, tag="set_weight_version"):
    """vLLM's `update_weight_version(new_version)` on every rank: the outputs of passes
    after it carry `weight_version` (vLLM labels each step's outputs with the engine's
    version; "default" until set); answered `applied`. Operators only."""

    weight_version: WeightVersionStr


class ReleaseKvCacheMemory(ClientMessageBase, tag="release_kv_cache_memory"):
    """vLLM's `release_kv_cache_memory()` on every rank, after a completed `pause`: clear
    the caches and put the KV cache to sleep (`wake_up` with tags `["kv_cache"]` brings it
    back); answered with `stats`. Operators only."""


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
    | Pause
    | Resume
    | Sleep
    | WakeUp
    | ReleaseKvCacheMemory
    | SetWeightVersion
)

# The engine-wide commands, which only an operator's connection may send (PROTOCOL.md §1.5).
OPERATOR_ONLY: Final = (
    ResetPrefixCache,
    SetVocabulary,
    SetFpmWorkerId,
    Pause,
    Resume,
    Sleep,
    WakeUp,
    ReleaseKvCacheMemory,
    SetWeightVersion,
)

# The `type` tags of every client message, in declaration order (fuzzers, docs and tests).
CLIENT_MESSAGE_TAGS: Final = tuple(str(c.__struct_config__.tag) for c in get_args(ClientMessage))
