"""Conversions between the core's values and control protocol messages.

The daemon calls these at the boundary: a decoded message becomes a core command, a pass's
request outputs and lifecycle events become streamed messages. Pure functions, no state.
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias, overload

from engined.core import types as core
from engined.wire.control import (
    DEFAULT_WEIGHT_VERSION,
    ActivateDestination,
    Cancel,
    CancelDestination,
    CancelSource,
    ClientMessage,
    DestinationReservedEvent,
    FinishReason,
    Load,
    OutputEntry,
    Pause,
    RankStats,
    ReleaseKvCacheMemory,
    ReleaseSource,
    ReserveDestination,
    ResetPrefixCache,
    Resume,
    SetVocabulary,
    Sleep,
    SourceHeldEvent,
    Submit,
    SubmitHandoffPrefill,
    WakeUp,
    WireLifecycleEvent,
    WireLoraRequest,
    WireRequest,
)


def to_core_request(
    request: WireRequest, request_id: str | None = None, stream_name: str | int | None = None
) -> core.Request:
    """The core's request; `dp_rank` is the daemon's routing concern and is not passed on.

    `request_id` replaces the message's (the daemon names a request the client left unnamed,
    or runs it under an alias); `stream_name` is then what keys its tokens (core `Request`).
    """
    return core.Request(
        token_ids=request.token_ids,
        max_tokens=request.max_tokens,
        request_id=request.request_id if request_id is None else request_id,
        output_token_ids=request.output_token_ids,
        seed=request.seed,
        stream_name=stream_name,
        priority=request.priority,
        stop_token_ids=request.stop_token_ids,
        min_tokens=request.min_tokens,
        cache_salt=request.cache_salt,
        lora_request=_core_lora(request.lora_request),
        kv_cache_report_mode=request.kv_cache_report_mode,
    )


def _core_lora(lora: WireLoraRequest | None) -> core.LoraRequest | None:
    if lora is None:
        return None
    return core.LoraRequest(lora.lora_name, lora.lora_int_id, lora.lora_path)


# The messages that are a command to a rank (`to_core_command`).
RankMessage: TypeAlias = (
    Submit
    | Cancel
    | SubmitHandoffPrefill
    | ReleaseSource
    | CancelSource
    | ReserveDestination
    | ActivateDestination
    | CancelDestination
    | ResetPrefixCache
    | SetVocabulary
    | Pause
    | Resume
    | Sleep
    | WakeUp
    | ReleaseKvCacheMemory
)


@overload
def to_core_command(
    msg: RankMessage, *, request_id: str | None = None, stream_name: str | int | None = None
) -> core.Command: ...


@overload
def to_core_command(
    msg: ClientMessage, *, request_id: str | None = None, stream_name: str | int | None = None
) -> core.Command | None: ...


def to_core_command(
    msg: ClientMessage, *, request_id: str | None = None, stream_name: str | int | None = None
) -> core.Command | None:
    """The core command a message asks of a rank; None for the daemon's own messages.

    (`hello`, `stats`, `ping`, `wait_idle` and the others a rank has no command for are
    answered without one.) `request_id` and `stream_name` are those of the request of a
    message that carries one, as in `to_core_request`. `reset_prefix_cache`,
    `set_vocabulary` and the pause and sleep messages become the command each rank they name
    is given.
    """
    match msg:
        case Submit():
            return core.Submit(to_core_request(msg.request, request_id, stream_name))
        case Cancel():
            return core.Cancel(msg.request_id)
        case SubmitHandoffPrefill():
            return core.SubmitHandoffPrefill(
                msg.handoff_id, to_core_request(msg.request, request_id, stream_name)
            )
        case ReleaseSource():
            return core.ReleaseSource(msg.handoff_id)
        case CancelSource():
            return core.CancelSource(msg.handoff_id)
        case ReserveDestination():
            return core.ReserveDestination(
                msg.handoff_id, to_core_request(msg.request, request_id, stream_name)
            )
        case ActivateDestination():
            return core.ActivateDestination(msg.handoff_id)
        case CancelDestination():
            return core.CancelDestination(msg.handoff_id)
        case ResetPrefixCache():
            return core.ResetPrefixCache(msg.reset_running_requests)
        case SetVocabulary():
            return core.SetVocabulary(msg.vocab_size, tuple(msg.excluded_token_ids))
        case Pause():
            return core.Pause(core.PauseMode(msg.mode), msg.clear_cache)
        case Resume():
            return core.Resume()
        case Sleep():
            return core.Sleep(msg.level, core.PauseMode(msg.mode))
        case WakeUp():
            return core.WakeUp(None if msg.tags is None else tuple(msg.tags))
        case ReleaseKvCacheMemory():
            return core.ReleaseKvCacheMemory()
        # SetWeightVersion is the daemon's (it labels the outputs it delivers).
        case _:
            return None


# Final: mypyc keeps it in a static rather than looking it up in the module's globals.
_FINISH_REASONS: Final[dict[core.FinishReason, FinishReason]] = {
    core.FinishReason.LENGTH: "length",
    core.FinishReason.REJECTED: "rejected",
    core.FinishReason.CANCELLED: "cancelled",
    core.FinishReason.STOP: "stop",
}


def to_output_entry(
    output: core.RequestOutput, request_id: str | None = None, weight_version: str | None = None
) -> OutputEntry:
    """The streamed form of one request's output of one pass (a speculative burst stays one
    entry, so the protocol keeps one entry per request per pass), under `request_id` when
    its owner knows it by another name (an alias, `RequestIds`), labelled `weight_version`
    (None: vLLM's "default")."""
    # Nearly every entry is unfinished: no enum hashing for those.
    finish_reason = output.finish_reason
    reason = None if finish_reason is None else _FINISH_REASONS[finish_reason]
    return OutputEntry(
        request_id=output.request_id if request_id is None else request_id,
        token_ids=output.new_token_ids,
        finished=reason is not None,
        finish_reason=reason,
        cached_tokens=output.cached_tokens,
        handoff_delay_ms=output.handoff_delay_ms,
        stop_reason=output.stop_reason,
        weight_version=weight_version,
    )


def to_wire_lifecycle(event: core.LifecycleEvent) -> WireLifecycleEvent:
    """The streamed form of a lifecycle event; a source's carries its transfer timing."""
    match event:
        case core.SourceHeld():
            return SourceHeldEvent(
                handoff_id=event.handoff_id,
                request_id=event.request_id,
                transfer_timing=event.transfer_timing,
            )
        case core.DestinationReserved():
            return DestinationReservedEvent(
                handoff_id=event.handoff_id,
                request_id=event.request_id,
                transferable_prompt_tokens=event.transferable_prompt_tokens,
            )
    raise TypeError(f"Not a lifecycle event: {event!r}")


def load_message(metrics: core.EngineMetrics) -> Load:
    """One `load` message (`watch_load`): the KV gauges of `stats`, pushed when they change."""
    return Load(
        dp_rank=metrics.dp_rank,
        active_blocks=metrics.active_blocks,
        total_blocks=metrics.total_blocks,
        kv_cache_usage=float(metrics.kv_cache_usage),
        running=metrics.running,
        waiting=metrics.waiting,
    )


# The core's gauges that a `stats` entry reports, under the same names (all but
# `waiting_deferred` and `waiting_for_kv`, which it does not).
_STATS_GAUGES: Final[tuple[str, ...]] = tuple(
    name for name in core.EngineMetrics.__struct_fields__ if name in RankStats.__struct_fields__
)


def rank_stats(
    metrics: core.EngineMetrics,
    *,
    passes_total: int,
    lateness_ms: tuple[float, float, float] = (0.0, 0.0, 0.0),
    kv_events_overflows: int = 0,
    weight_version: str | None = None,
) -> RankStats:
    """One `stats` entry: the core's gauges as they are, the daemon's counters beside them."""
    gauges: dict[str, Any] = {name: getattr(metrics, name) for name in _STATS_GAUGES}
    return RankStats(
        **gauges,
        passes_total=passes_total,
        lateness_p50_ms=lateness_ms[0],
        lateness_p99_ms=lateness_ms[1],
        lateness_max_ms=lateness_ms[2],
        kv_events_overflows=kv_events_overflows,
        weight_version=DEFAULT_WEIGHT_VERSION if weight_version is None else weight_version,
    )
