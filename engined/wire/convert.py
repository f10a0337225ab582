"""Conversions between the core's values and control protocol messages.

The daemon calls these at the boundary: a decoded message becomes a core command, a pass's
output signals and lifecycle events become streamed messages. Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engined.core import types as core
from engined.wire.control import (
    ActivateDestination,
    Cancel,
    CancelDestination,
    CancelSource,
    ClientMessage,
    DestinationReservedEvent,
    FinishReason,
    Load,
    OutputEntry,
    RankStats,
    ReleaseSource,
    ReserveDestination,
    SourceHeldEvent,
    Submit,
    SubmitHandoffPrefill,
    WireLifecycleEvent,
    WireRequest,
)


def to_core_request(request: WireRequest) -> core.Request:
    """The core's request; `dp_rank` is the daemon's routing concern and is not passed on."""
    return core.Request(
        token_ids=request.token_ids,
        max_tokens=request.max_tokens,
        request_id=request.request_id,
        output_token_ids=request.output_token_ids,
    )


def to_core_command(msg: ClientMessage) -> core.Command | None:
    """The core command a message asks for; None for the daemon's own messages.

    (`hello`, `stats`, `reset_prefix_cache`, `ping` are answered without a core command.)
    """
    match msg:
        case Submit():
            return core.Submit(to_core_request(msg.request))
        case Cancel():
            return core.Cancel(msg.request_id)
        case SubmitHandoffPrefill():
            return core.SubmitHandoffPrefill(msg.handoff_id, to_core_request(msg.request))
        case ReleaseSource():
            return core.ReleaseSource(msg.handoff_id)
        case CancelSource():
            return core.CancelSource(msg.handoff_id)
        case ReserveDestination():
            return core.ReserveDestination(msg.handoff_id, to_core_request(msg.request))
        case ActivateDestination():
            return core.ActivateDestination(msg.handoff_id)
        case CancelDestination():
            return core.CancelDestination(msg.handoff_id)
        case _:
            return None


@dataclass(slots=True)
class _EntryBuilder:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int | None = None
    handoff_delay_ms: float | None = None


def group_outputs(signals: Iterable[core.OutputSignal]) -> list[OutputEntry]:
    """Fold per-token signals into one entry per request, in order of first appearance.

    The daemon calls this once per client per pass, which is what keeps a speculative burst
    in one entry and the protocol at one `output` message per client per pass.
    """
    builders: dict[str, _EntryBuilder] = {}
    for signal in signals:
        builder = builders.get(signal.request_id)
        if builder is None:
            builder = builders[signal.request_id] = _EntryBuilder()
        if signal.token_id is not None:
            builder.token_ids.append(signal.token_id)
        if signal.cached_tokens is not None and builder.cached_tokens is None:
            builder.cached_tokens = signal.cached_tokens
        if signal.handoff_delay_ms is not None:
            builder.handoff_delay_ms = signal.handoff_delay_ms
        if signal.completed:
            builder.finish_reason = "rejected" if signal.rejected else "length"
    return [
        OutputEntry(
            request_id=request_id,
            token_ids=b.token_ids,
            finished=b.finish_reason is not None,
            finish_reason=b.finish_reason,
            cached_tokens=b.cached_tokens,
            handoff_delay_ms=b.handoff_delay_ms,
        )
        for request_id, b in builders.items()
    ]


def to_wire_lifecycle(event: core.LifecycleEvent) -> WireLifecycleEvent:
    """The streamed form of a lifecycle event (the source's transfer timing stays inside)."""
    match event:
        case core.SourceHeld():
            return SourceHeldEvent(handoff_id=event.handoff_id, request_id=event.request_id)
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


def rank_stats(
    metrics: core.EngineMetrics,
    *,
    passes_total: int,
    lateness_ms: tuple[float, float, float] = (0.0, 0.0, 0.0),
    kv_events_overflows: int = 0,
) -> RankStats:
    """One `stats` entry; the pass count is the daemon's, the gauges the core's."""
    return RankStats(
        dp_rank=metrics.dp_rank,
        active_blocks=metrics.active_blocks,
        inactive_blocks=metrics.inactive_blocks,
        total_blocks=metrics.total_blocks,
        kv_cache_usage=float(metrics.kv_cache_usage),
        running=metrics.running,
        waiting=metrics.waiting,
        preemptions_total=metrics.preemptions_total,
        passes_total=passes_total,
        lateness_p50_ms=lateness_ms[0],
        lateness_p99_ms=lateness_ms[1],
        lateness_max_ms=lateness_ms[2],
        g2_active_blocks=metrics.g2_active_blocks,
        g2_inactive_blocks=metrics.g2_inactive_blocks,
        g2_total_blocks=metrics.g2_total_blocks,
        g3_active_blocks=metrics.g3_active_blocks,
        g3_inactive_blocks=metrics.g3_inactive_blocks,
        g3_total_blocks=metrics.g3_total_blocks,
        kv_events_overflows=kv_events_overflows,
    )
