"""engined's `Engine` on the parity scenarios, in the trace format of `parity.trace`.

One pass is one step. Arrivals are submitted before the pass of their step, and passes run
back to back, `now_ms` advancing to each pass's `end_ms` (engined's pacing and speedup do not
matter here). engined draws its own output tokens, so it runs first: its tokens, by request
and position, are what the vLLM side samples.
"""

from __future__ import annotations

import os

from engined.core.args import EngineArgs, SchedulingPolicy
from engined.core.engine import Engine
from engined.core.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cancel,
    Command,
    KvEvent,
    LoraRequest,
    PassResult,
    Pause,
    PauseMode,
    ReleaseKvCacheMemory,
    Request,
    ResetPrefixCache,
    Resume,
    Submit,
    WakeUp,
)
from engined.core.vllm_hashing import HashAlgo
from parity.scenario import MAX_STEPS, Control, Scenario
from parity.trace import (
    Admitted,
    CachedReport,
    Cleared,
    Removed,
    Scheduled,
    Step,
    StopReport,
    Stored,
    Trace,
)
from parity.trace import KvEvent as TraceEvent


def engine_args(scenario: Scenario) -> EngineArgs:
    """The `EngineArgs` equivalent to the scenario's vLLM configuration."""
    config = scenario.config
    return EngineArgs(
        block_size=config.block_size,
        num_gpu_blocks=config.num_gpu_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        scheduling_policy=SchedulingPolicy(config.scheduling_policy),
        scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
        prefix_caching_hash_algo=HashAlgo(config.prefix_caching_hash_algo),
        async_scheduling=config.async_scheduling,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
        watermark=config.watermark,
        max_num_active_seqs=config.max_num_active_seqs,
        max_num_scheduled_tokens=config.max_num_scheduled_tokens,
        prefill_schedule_interval=config.prefill_schedule_interval,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        vocab_size=config.vocab_size,
        aic_nextn=config.num_speculative_tokens or None,
        aic_nextn_accept_rates=config.mtp_accept_rates if config.num_speculative_tokens else None,
        lookahead_block_hashes=config.speculative_method != "draft_model"
        and not config.disable_lookahead_block_hashes,
        eagle_block_drop=config.disable_lookahead_block_hashes,
        drafting_slots=1 if config.speculative_method == "draft_model" else 0,
    )


def _hash_str(value: int | None) -> str | None:
    return None if value is None else str(value)


def trace_events(events: list[KvEvent]) -> list[TraceEvent]:
    """engined's KV events in the trace's terms: a grouped removal is one `Removed` per hash."""
    out: list[TraceEvent] = []
    for event in events:
        if isinstance(event, BlockStored):
            out.append(
                Stored(
                    [str(h) for h in event.block_hashes],
                    _hash_str(event.parent_hash),
                    list(event.token_ids),
                    event.block_size,
                    _extra_keys(event),
                    event.lora_id,
                    event.lora_name,
                    event.lookahead_token_ids,
                )
            )
        elif isinstance(event, BlockRemoved):
            out.extend(Removed(str(h)) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            out.append(Cleared())
    return out


def _extra_keys(event: BlockStored) -> list[list[str] | None]:
    """The event's extra keys as the wire carries them (one nil per block without any)."""
    keys = event.extra_keys or [None] * len(event.block_hashes)
    return [None if k is None else list(k) for k in keys]


def _step(index: int, result: PassResult) -> Step:
    assert result.trace is not None
    step = Step(index=index)
    step.scheduled = [Scheduled(s.request_id, s.computed, s.new) for s in result.trace.scheduled]
    shares = {s.request_id: s.computed for s in step.scheduled}
    step.admitted = [Admitted(a.request_id, shares[a.request_id]) for a in result.admissions]
    step.preempted = list(result.trace.preempted)
    for output in result.request_outputs():
        if output.cached_tokens is not None:
            step.cached.append(CachedReport(output.request_id, output.cached_tokens))
        if output.finish_reason is not None:
            step.finished.append(output.request_id)
        if output.stop_reason is not None:
            step.stopped.append(StopReport(output.request_id, output.stop_reason))
    step.running = result.metrics.running
    step.waiting = result.metrics.waiting
    step.events = trace_events(result.kv_events)
    return step


def _commands(control: Control) -> list[Command]:
    match control.kind:
        case "abort":
            return [Cancel(request_id) for request_id in control.request_ids]
        case "pause":
            return [Pause(PauseMode(control.mode), control.clear_cache)]
        case "reset_running":
            return [ResetPrefixCache(reset_running_requests=True)]
        case "release":
            return [ReleaseKvCacheMemory()]
        case "wake_up":
            return [WakeUp(("kv_cache",))]
    return [Resume()]


def run(scenario: Scenario) -> Trace:
    """The scenario through a fresh engine; the trace carries the tokens it generated."""
    # The vLLM side inherits this environment: both derive NONE_HASH from the same seed.
    engine = Engine(
        engine_args(scenario), record=True, python_hash_seed=os.environ.get("PYTHONHASHSEED")
    )
    arrivals = scenario.arrivals()
    last_arrival = scenario.last_event()
    trace = Trace(scenario=scenario.name)
    generated: dict[str, list[int]] = {}
    now_ms = 0.0
    index = 0
    while index <= last_arrival or not engine.is_empty():
        if index >= MAX_STEPS:
            trace.error = f"still busy after {MAX_STEPS} steps"
            break
        arrived: list[TraceEvent] = []
        for control in scenario.controls_at(index):
            for command in _commands(control):
                arrived += trace_events(engine.apply(command, now_ms=now_ms).kv_events)
        for request in arrivals.get(index, []):
            lora = request.lora
            submitted = Request(
                token_ids=list(request.prompt),
                max_tokens=request.max_tokens,
                request_id=request.id,
                priority=request.priority,
                output_token_ids=request.output_token_ids,
                stop_token_ids=request.stop_token_ids or None,
                min_tokens=request.min_tokens,
                cache_salt=request.cache_salt,
                kv_cache_report_mode=request.kv_cache_report_mode,
                lora_request=None
                if lora is None
                else LoraRequest(lora.name, lora.int_id, lora.path),
            )
            effects = engine.apply(Submit(submitted), now_ms=now_ms)
            arrived += trace_events(effects.kv_events)
        result = engine.execute_pass(now_ms)
        for output in result.request_outputs():
            generated.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.new_token_ids:
                trace.bursts.setdefault(output.request_id, []).append(len(output.new_token_ids))
        step = _step(index, result)
        step.events = arrived + step.events
        trace.steps.append(step)
        now_ms = max(result.end_ms, now_ms)
        index += 1
    trace.output_tokens = generated
    return trace
