"""`Engine`: one data-parallel rank of the vLLM scheduler that Dynamo's mocker 1.3.0 models.

This file is the engine's whole contract. Everything is a call that returns what it did:

* `apply(command, *, now_ms) -> CommandEffects`: a command between passes (submit, cancel,
  the handoff commands, vocabulary, prefix-cache reset, vLLM's pause and sleep), with the
  requests it ended, the handoff events and KV events it caused.
* `execute_pass(now_ms) -> PassResult`: vLLM's `schedule()` and `update_from_output()` in
  one deterministic call (with `async_scheduling`, one `step_with_batch_queue()`: the
  schedule of a batch and the update from the one before; engined/core/paged/async_batches.py):
  one `RequestOutput` per request that produced tokens or ended,
  the requests that ended and why, admissions, handoff and KV events, FPM, gauges, the
  modeled end of the pass, and whether it progressed at all.
* `advance_tiers(now_ms) -> TierAdvance`: the offload tiers' transfers due by `now_ms`
  landed between passes; `next_deadline()` says when the next one is due.
* `metrics()`, `num_waiting()`, `is_empty()`, `is_drained()`; read-only `inspect(request_id)`,
  `inspect_handoff(handoff_id)` and `queues()` for tests and tools.

Time is data: every call takes `now_ms` from the caller, a pass returns its modeled
`end_ms`, and the same calls give the same results. After every command, pass and tier
advance the engine retries the head of its pending destinations itself.

The engine is composed of parts that get their collaborators when built here, and never the
engine: the request intake, the scheduler (engined/core/scheduling.py) with its preempter,
the token emitter (emission.py), the finisher (finish.py), the commands (commands.py), the
handoff book (handoff_book.py), the onboard parking (offload/parking.py), and the KV manager
(kv_manager.py) with its event log and, with offload tiers, the tier engine's G1 glue.
"""

from __future__ import annotations

import sys

import msgspec

from engined.core import inspection
from engined.core.args import EngineArgs, EngineType
from engined.core.assembly import EngineParts, assemble
from engined.core.errors import UnsupportedError
from engined.core.fpm import build_snapshot
from engined.core.offload.tier_engine import TierEngine
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.pass_context import PassContext
from engined.core.pass_trace import PassTrace
from engined.core.pause_types import PauseState
from engined.core.pausing import PauseControl
from engined.core.types import (
    Command,
    CommandEffects,
    Decodes,
    EndedRequest,
    EngineMetrics,
    FinishReason,
    FpmSnapshot,
    Noop,
    PassResult,
    RequestOutput,
    TierAdvance,
)
from engined.core.views import HandoffView, QueueView, RequestView

_UNBOUNDED = sys.maxsize
_MASK64 = (1 << 64) - 1


class Engine:
    """The scheduler of one data-parallel rank: requests, KV blocks, handoffs, passes."""

    __slots__ = (
        "_batches",
        "_book",
        "_commands",
        "_emitter",
        "_kv",
        "_parking",
        "_parts",
        "_pausing",
        "_queued",
        "_residency",
        "_scheduler",
        "_state",
        "args",
        "block_size",
        "dp_rank",
        "num_blocks",
        "paged",
        "usable_blocks",
        "worker_id",
    )

    def __init__(
        self,
        args: EngineArgs,
        *,
        dp_rank: int = 0,
        worker_id: int = 0,
        tiers: TierEngine | None = None,
        fast_paths: bool = True,
        python_hash_seed: str | None = None,
        record: bool = False,
    ) -> None:
        """Build the rank's engine from `args` (normalized here).

        `tiers` gives it a tier engine built elsewhere (tests); otherwise `args` build one
        when they ask for offload tiers (`OffloadConfig.from_args`). `fast_paths=False`
        turns the hand-inlined decode steps off (the equivalence test only); `record=True`
        gives each `PassResult` its `trace` (the parity harness only).
        `python_hash_seed` is the shell's `PYTHONHASHSEED`, from which vLLM semantics derive
        NONE_HASH as vLLM does (engined/core/vllm_hashing.py): the core reads no environment.

        Raises:
            InvalidArgsError: `args` fail validation.
            UnsupportedError: `engine_type = sglang`.
        """
        args = args.normalized()
        if args.engine_type is EngineType.SGLANG:
            raise UnsupportedError("engine_type=sglang is not supported by the vLLM core")
        self.args = args
        self.dp_rank = dp_rank
        self.worker_id = worker_id
        self.block_size = args.block_size
        self.num_blocks = args.num_gpu_blocks
        self._parts = parts = assemble(
            args,
            dp_rank=dp_rank,
            worker_id=worker_id,
            tiers=tiers,
            fast_paths=fast_paths,
            python_hash_seed=python_hash_seed,
        )
        self.paged = isinstance(parts.kv, PagedKvManager)
        self._residency = parts.kv.pool.residency if isinstance(parts.kv, PagedKvManager) else None
        self.usable_blocks = parts.kv.usable_blocks
        self._state = parts.state
        self._kv = parts.kv
        self._book = parts.book
        self._parking = parts.parking
        self._queued = parts.queued
        self._scheduler = parts.scheduler
        self._emitter = parts.emitter
        self._commands = parts.commands
        self._batches = parts.batches
        self._pausing = parts.pausing
        parts.preempter.victims = [] if record else None

    @property
    def parts(self) -> EngineParts:
        """White-box access for tests (see `EngineParts`)."""
        return self._parts

    # --- commands -----------------------------------------------------------------------

    def apply(self, command: Command, *, now_ms: float) -> CommandEffects:
        """Apply one command at `now_ms`; raises its `CoreError` having changed nothing."""
        outcome = self._commands.apply(command, now_ms)
        kv_events = self._kv.take_events()
        progressed = not isinstance(outcome.result, Noop) or bool(
            outcome.lifecycle_events or kv_events
        )
        return CommandEffects(
            outcome.result, outcome.lifecycle_events, outcome.ended, kv_events, progressed
        )

    # --- the pass -----------------------------------------------------------------------

    def execute_pass(self, now_ms: float) -> PassResult:
        """One engine step starting at `now_ms`: advance the tiers (with them), schedule
        running then waiting requests, emit the ready tokens, then retry the pending
        destination. The result's `end_ms` is the step's modeled end (`now_ms` when it did
        nothing that takes time, or the next tier deadline when it could only wait).
        Paused or asleep (engined/core/pausing.py), `_paused_pass` runs it instead."""
        pausing = self._pausing
        if pausing is not None and pausing.engaged:
            return self._paused_pass(pausing, now_ms)
        ctx = PassContext(now_ms, self._scheduler.max_batched_tokens, self._parts.preempter.victims)
        result = self._pass(ctx)
        if pausing is not None:
            pausing.finished_pending = bool(result.ended)
        return result

    def _paused_pass(self, pausing: PauseControl, now_ms: float) -> PassResult:
        """A pass under vLLM's pause: none at all without work (EngineCore does not step),
        else one with no budget (PAUSED_ALL) or admitting only requests holding KV
        (PAUSED_NEW); then the pauses complete if the engine is left without work, their
        preemptions and AllBlocksCleared joining the pass's."""
        victims = self._parts.preempter.victims
        if pausing.has_work():
            state = pausing.state
            budget = 0 if state is PauseState.PAUSED_ALL else self._scheduler.max_batched_tokens
            ctx = PassContext(now_ms, budget, victims)
            ctx.kv_holding_only = state is PauseState.PAUSED_NEW
            result = self._pass(ctx)
        else:
            trace = None if victims is None else PassTrace([], [])
            metrics = self.metrics()
            result = PassResult(
                now_ms, [], Decodes(), [], [], [], metrics, [], FpmSnapshot(), False, trace=trace
            )
        before = result.metrics
        pausing.after_pass(bool(result.ended))
        if victims:
            # The cache clear's preemptions (or a command's before this pass) are this pass's.
            trace = result.trace
            assert trace is not None
            result = msgspec.structs.replace(
                result, trace=PassTrace(trace.scheduled, trace.preempted + victims)
            )
            victims.clear()
        metrics = self.metrics()
        if metrics == before:
            return result
        events = result.kv_events + self._kv.take_events()
        return msgspec.structs.replace(result, metrics=metrics, kv_events=events, progressed=True)

    def _pass(self, ctx: PassContext) -> PassResult:
        now_ms = ctx.now_ms
        before = self.metrics()
        tiers = self._kv.offload
        if tiers is not None:
            self._parking.advance(now_ms)
        batches = self._batches
        resolved = True
        if batches is None:
            scheduler = self._scheduler
            scheduler.schedule(ctx)
            ctx.read_shares(self._state.requests)
            prefill_ms = scheduler.prefill_ms(ctx)
            decode_ms = self._emitter.emit(ctx)
        else:
            prefill_ms, resolved = batches.step(ctx)
            decode_ms = 0.0
        outputs = ctx.outputs
        ended = ctx.ended
        for request_id in ctx.rejected:
            ctx.add_output(RequestOutput(request_id, [], FinishReason.REJECTED))
            ended.append(EndedRequest(request_id, FinishReason.REJECTED))
        end_ms = now_ms + prefill_ms + decode_ms
        if tiers is not None and end_ms <= now_ms:
            # Stall-advance: nothing took time, so the next thing that can happen is a transfer.
            deadline = tiers.engine.earliest_pending_deadline()
            if deadline is not None:
                end_ms = max(deadline, now_ms)
        lifecycle = ctx.lifecycle
        lifecycle += self._commands.retry_pending_destinations(now_ms)
        metrics = self.metrics()
        # Async scheduling: a pass that resolved no batch publishes nothing yet (vLLM
        # publishes KV events from `update_from_output`).
        kv_events = self._kv.take_events() if resolved else []
        queued = self._queued
        # Modelled seconds, as every core time; the engine loop reports them as wall time.
        wall_time_secs = (end_ms - now_ms) / 1000.0
        fpm = build_snapshot(
            ctx.scheduled,
            queued.prefill.summary(),
            queued.decode.summary(),
            wall_time_secs,
        )
        decoded_ids = ctx.decoded_ids
        progressed = bool(
            outputs
            or decoded_ids
            or ctx.admissions
            or kv_events
            or lifecycle
            or ended
            or wall_time_secs > 0
            or metrics != before
            or not resolved
        )
        return PassResult(
            end_ms,
            outputs,
            Decodes(decoded_ids, ctx.decoded_tokens, ctx.decoded_before),
            ended,
            ctx.admissions,
            lifecycle,
            metrics,
            kv_events,
            fpm,
            progressed,
            ctx.cache_queries,
            ctx.cache_hits,
            ctx.output_tokens,
            ctx.decode_forwards,
            ctx.trace(),
            self._residency.take() if self._residency is not None else [],
            ctx.spec_drafts,
            ctx.spec_draft_tokens,
            ctx.spec_accepted_tokens,
            ctx.spec_accepted_per_pos,
        )

    # --- offload tiers ------------------------------------------------------------------

    def advance_tiers(self, now_ms: float) -> TierAdvance:
        """Land the tier transfers due by `now_ms` between passes, then retry the pending
        destination. A pass does this itself; call it when no pass runs (an idle engine
        woken at `next_deadline()`). Without tiers it changes nothing."""
        lifecycle = []
        if self._kv.offload is not None:
            self._parking.advance(now_ms)
            lifecycle = self._commands.retry_pending_destinations(now_ms)
        return TierAdvance(self._kv.take_events(), lifecycle)

    def next_deadline(self) -> float | None:
        """The next time a tier transfer completes; None without tiers or transfers."""
        tiers = self._kv.offload
        return tiers.engine.earliest_pending_deadline() if tiers is not None else None

    # --- state --------------------------------------------------------------------------

    def is_empty(self) -> bool:
        """No request is queued, running or parked (held sources and destinations aside),
        and no pause waits for a pass to complete (engined/core/pausing.py)."""
        pausing = self._pausing
        if pausing is not None and pausing.engaged and pausing.pending_step():
            return False
        return not self._state.requests

    def is_drained(self) -> bool:
        """Empty, no handoff record, and no tier transfer left to land."""
        return (
            not self._state.requests
            and self._book.is_idle()
            and not self._parking
            and self.next_deadline() is None
        )

    def num_waiting(self) -> int:
        """Requests queued here and not running: waiting, parked, and destinations not yet
        activated (the `waiting` gauge, without building the gauges)."""
        book = self._book
        return len(self._state.waiting) + len(book.pending) + len(book.held) + len(self._parking)

    def metrics(self) -> EngineMetrics:
        """The rank's gauges now (every `PassResult` carries them as of its end)."""
        pausing = self._pausing
        if pausing is not None and pausing.engaged:
            return pausing.gauges(self._metrics())
        return self._metrics()

    def _metrics(self) -> EngineMetrics:
        kv = self._kv
        state = self._state
        active = kv.num_active_blocks()
        waiting = self.num_waiting()
        loading = len(self._book.held) + len(self._parking)
        deferred = loading + len(state.deferred)
        num_blocks = self.num_blocks
        tiers = kv.offload
        if tiers is None:
            # vLLM's usage leaves its null block out.
            usable = self.usable_blocks
            return EngineMetrics(
                self.dp_rank,
                active,
                kv.num_inactive_blocks(),
                num_blocks,
                active / usable,
                len(state.running_members),
                waiting,
                state.preemptions_total,
                waiting_deferred=deferred,
                waiting_for_kv=loading,
            )
        g2 = tiers.engine.g2.pool
        g3 = tiers.engine.g3.pool if tiers.engine.g3 is not None else None
        return EngineMetrics(
            self.dp_rank,
            active,
            kv.num_inactive_blocks(),
            num_blocks,
            active / num_blocks,
            len(state.running_members),
            waiting,
            state.preemptions_total,
            g2.num_active,
            g2.num_inactive,
            g2.num_blocks,
            g3.num_active if g3 is not None else 0,
            g3.num_inactive if g3 is not None else 0,
            g3.num_blocks if g3 is not None else 0,
            deferred,
            loading,
        )

    # --- inspection (engined/core/inspection.py) ------------------------------------------

    def inspect(self, request_id: str) -> RequestView | None:
        """A snapshot of one request, wherever the engine holds it; None if it does not."""
        return inspection.inspect_request(self._parts, request_id)

    def inspect_handoff(self, handoff_id: str) -> HandoffView | None:
        """A snapshot of one handoff this engine takes part in; None if it has no record."""
        return inspection.inspect_handoff(self._parts, handoff_id)

    def queues(self) -> QueueView:
        """The waiting queue, the running list and the parked requests, in order."""
        return inspection.queues(self._parts)
