"""LEGACY: the daemon's pre-restructure view of a core. Removed when the shell consumes results.

Until the shell (engined/server/engine_loop.py, metrics.py, control.py) consumes
`PassResult`, `CommandEffects` and `TierAdvance` of `engined.core.engine.Engine` directly
(issue 11, phase B), it drives this `VllmCore`: the old method names over one `Engine`, and
read access to the tables it still reconciles against. Nothing here adds behaviour:

* Commands the old API applied without a time (`cancel`, `reset_prefix_cache`,
  `apply_command`, `receive`) are applied at the last pass's or tick's `now_ms`, the time an
  offload they cause started at before.
* The engine returns each call's KV events with the call; the old API published command
  events with the next pass (or `take_kv_events` on an empty core), so they are kept here
  and put in front of the next pass's or tick's events. Likewise the handoff events of the
  pending-destination retry that follows an old-API command come back from the next
  `retry_pending_destinations()`, where the shell looks for them.
* `PassResult.output_signals` and `completed_requests` (engined/core/types.py) are the
  old per-token view of a pass.
"""

from __future__ import annotations

import msgspec

from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.core.handoff import DestinationHolds, PendingDestinations, SourceHolds
from engined.core.kv_manager import KvManager
from engined.core.offload.tier_engine import TierEngine
from engined.core.state import SchedulerState
from engined.core.types import (
    APPLIED,
    Cancel,
    Command,
    CommandEffects,
    CommandResult,
    EngineMetrics,
    FinishReason,
    KvEvent,
    LifecycleEvent,
    OutputSignal,
    PassResult,
    Request,
    RequestOutput,
    ResetPrefixCache,
    Submit,
    Submitted,
    TierAdvance,
)

__all__ = ["VllmCore", "outputs_of"]


class VllmCore:
    """The old core API over one `Engine` (legacy; see the module docstring)."""

    def __init__(
        self,
        args: EngineArgs,
        *,
        dp_rank: int = 0,
        worker_id: int = 0,
        tiers: TierEngine | None = None,
    ) -> None:
        self.engine = Engine(args, dp_rank=dp_rank, worker_id=worker_id, tiers=tiers)
        self.args = self.engine.args
        self.dp_rank = dp_rank
        self.worker_id = worker_id
        self.block_size = self.engine.block_size
        self.num_blocks = self.engine.num_blocks
        self._now_ms = 0.0
        self._kv_backlog: list[KvEvent] = []
        self._lifecycle_backlog: list[LifecycleEvent] = []

    # --- tables the shell still reads ---------------------------------------------------

    @property
    def state(self) -> SchedulerState:
        return self.engine.parts.state

    @property
    def kv(self) -> KvManager:
        return self.engine.parts.kv

    @property
    def source_holds(self) -> SourceHolds:
        return self.engine.parts.book.sources

    @property
    def pending_destinations(self) -> PendingDestinations:
        return self.engine.parts.book.pending

    @property
    def destination_holds(self) -> DestinationHolds:
        return self.engine.parts.book.held

    # --- commands -----------------------------------------------------------------------

    def _keep(self, effects: CommandEffects) -> CommandEffects:
        self._kv_backlog += effects.kv_events
        return effects

    def apply_live_command(
        self, command: Command, allow_destination_admission: bool, now_ms: float
    ) -> CommandEffects:
        """`Engine.apply` at `now_ms` (the destination retry always follows)."""
        return self._keep(self.engine.apply(command, now_ms=now_ms))

    def apply_command_effects(
        self, command: Command, allow_destination_admission: bool = True
    ) -> CommandEffects:
        return self._keep(self.engine.apply(command, now_ms=self._now_ms))

    def apply_command(self, command: Command) -> CommandResult:
        return self.apply_command_effects(command).result

    def receive(self, request: Request) -> str:
        """Submit a request; returns its id. Raises on a duplicate id."""
        result = self.apply_command(Submit(request))
        assert isinstance(result, Submitted)
        return result.request_id

    def _apply_quietly(self, command: Command) -> CommandResult:
        """A command the shell applies without looking at its effects: the handoff events
        of the retry that follows come back from `retry_pending_destinations`."""
        effects = self.apply_command_effects(command)
        self._lifecycle_backlog += effects.lifecycle_events
        return effects.result

    def cancel(self, request_id: str) -> CommandResult:
        return self._apply_quietly(Cancel(request_id))

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (publishes AllBlocksCleared); False while blocks are in use."""
        return self._apply_quietly(ResetPrefixCache()) is APPLIED

    def retry_pending_destinations(self) -> list[LifecycleEvent]:
        """The handoff events of old-API commands' retries (the engine retries by itself)."""
        events = self._lifecycle_backlog
        self._lifecycle_backlog = []
        return events

    # --- passes and tiers ---------------------------------------------------------------

    def execute_pass(self, now_ms: float) -> PassResult:
        self._now_ms = now_ms
        result = self.engine.execute_pass(now_ms)
        if self._kv_backlog:
            events = self._kv_backlog + result.kv_events
            self._kv_backlog = []
            result = msgspec.structs.replace(result, kv_events=events)
        return result

    def take_kv_events(self) -> list[KvEvent]:
        events = self._kv_backlog
        self._kv_backlog = []
        return events

    def earliest_offload_deadline(self) -> float | None:
        return self.engine.next_deadline()

    def tick_offload_only(self, now_ms: float) -> TierAdvance:
        self._now_ms = now_ms
        advanced = self.engine.advance_tiers(now_ms)
        if not self._kv_backlog:
            return advanced
        events = self._kv_backlog + advanced.kv_events
        self._kv_backlog = []
        return TierAdvance(events, advanced.lifecycle_events)

    # --- state --------------------------------------------------------------------------

    def is_empty(self) -> bool:
        return self.engine.is_empty()

    def is_drained(self) -> bool:
        return self.engine.is_drained()

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()


def outputs_of(signals: list[OutputSignal]) -> list[RequestOutput]:
    """Per-request outputs of per-token signals (legacy), in order of first appearance."""
    grouped: dict[str, list[OutputSignal]] = {}
    for signal in signals:
        grouped.setdefault(signal.request_id, []).append(signal)
    outputs: list[RequestOutput] = []
    for request_id, group in grouped.items():
        last = group[-1]
        reason = (
            (FinishReason.REJECTED if last.rejected else FinishReason.LENGTH)
            if last.completed
            else None
        )
        outputs.append(
            RequestOutput(
                request_id,
                [s.token_id for s in group if s.token_id is not None],
                reason,
                next((s.cached_tokens for s in group if s.cached_tokens is not None), None),
                last.handoff_delay_ms,
            )
        )
    return outputs
