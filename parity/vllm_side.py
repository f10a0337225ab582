"""vLLM 0.33's real v1 `Scheduler` on the parity scenarios; runs INSIDE the vLLM venv.

Reads a msgpack list of `VllmJob` on stdin and writes a msgpack list of `Trace` on stdout,
one vLLM import for every scenario (the import alone takes 15-100 s). It may import only
vllm, torch, msgspec, the stdlib and the engined-free `parity.scenario`/`parity.trace`.

One step is what `EngineCore.step()` does without a model: apply the pauses, resumes and
aborts of the step (`pause_generation`, `resume_scheduler`, `abort_requests`: below), add
the requests arriving at it, `schedule()`, a `ModelRunnerOutput` with one sampled token for
every scheduled request that has caught up with its tokens (none for a partial prefill
chunk), `update_from_output()`.
The sampled token is engined's token for that request at that output position. Preemptions
are recorded by wrapping the scheduler's `_preempt_request`, in call order; KV events by a
recorder in place of the (null) publisher.

A pause is EngineCoreProc's: `abort` calls `finish_requests(None, FINISHED_ABORTED)`, then
`set_pause_state` (PAUSED_ALL for `keep`, else PAUSED_NEW); it completes at once if the
engine has no work (`not scheduler.has_requests()`), else once a step leaves it none (the
idle callbacks, last registered first); completing with `clear_cache` is `_reset_caches`'
`reset_prefix_cache(reset_running_requests=True, reset_connector=True)`. While a pause is
set or pending, a step without work schedules nothing, as EngineCore does not step then.

With `async_scheduling` the scheduler is vLLM's `AsyncScheduler` and one step is one
`EngineCore.step_with_batch_queue()` with its batch queue of 2: schedule a batch if there
are requests and queue it (its fabricated output, sampled for every request it does not
leave mid-prefill, is known at once); return there if the queue is not full and something
ran or remains; otherwise take the oldest batch and `update_from_output()` it. So a step
schedules batch N and delivers batch N-1's tokens, and the first step delivers nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import msgspec

from parity.scenario import (
    MAX_STEPS,
    Config,
    Control,
    Scenario,
    ScenarioRequest,
    VllmJob,
    fallback_token,
)
from parity.trace import (
    Admitted,
    CachedReport,
    Cleared,
    KvEvent,
    Removed,
    Scheduled,
    Step,
    StopReport,
    Stored,
    Trace,
)
from parity.vllm_spec import MTP_MODEL, Drafts, speculative_config

# A tiny Llama: the scheduler reads only lengths and limits from the model config.
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 1 << 20,
    "torch_dtype": "float32",
}


def _hash_str(block_hash: Any) -> str:
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


class _Recorder:
    """Stands in for the scheduler's KV event publisher: keeps the events of a step."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def publish(self, batch: Any) -> None:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                parent = event.parent_block_hash
                self.events.append(
                    Stored(
                        [_hash_str(h) for h in event.block_hashes],
                        None if parent is None else _hash_str(parent),
                        list(event.token_ids),
                        event.block_size,
                        None
                        if event.extra_keys is None
                        else [None if k is None else list(k) for k in event.extra_keys],
                        event.lora_id,
                        event.lora_name,
                        event.lookahead_token_ids,
                    )
                )
            elif kind == "BlockRemoved":
                self.events.extend(Removed(_hash_str(h)) for h in event.block_hashes)
            elif kind == "AllBlocksCleared":
                self.events.append(Cleared())
            else:
                raise TypeError(f"unexpected KV event {kind}")

    def shutdown(self) -> None:
        pass


class VllmRun:
    """One scenario through a fresh scheduler (fresh block pool, fresh hashes)."""

    def __init__(self, job: VllmJob, model_dir: str) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            KVEventsConfig,
            LoRAConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        self.job = job
        config: Config = job.scenario.config
        num_spec = config.num_speculative_tokens
        draft_dir = model_dir
        if num_spec and config.speculative_method == "mtp":
            model_dir = os.path.join(model_dir, "mtp")
        model_config = ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            max_model_len=config.max_model_len,
            seed=config.seed,
            dtype="float32",
        )
        cache_config = CacheConfig(
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        )
        cache_config.num_gpu_blocks = config.num_gpu_blocks
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            is_encoder_decoder=False,
            policy=config.scheduling_policy,
            scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
            async_scheduling=config.async_scheduling,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
            watermark=config.watermark,
            max_num_active_seqs=config.max_num_active_seqs,
            max_num_scheduled_tokens=config.max_num_scheduled_tokens,
            prefill_schedule_interval=config.prefill_schedule_interval,
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            lora_config=LoRAConfig(max_loras=config.max_loras) if config.enable_lora else None,
            speculative_config=speculative_config(model_config, num_spec, config, draft_dir)
            if num_spec
            else None,
        )
        self.drafts = Drafts(num_spec, job.bursts) if num_spec else None
        spec = FullAttentionSpec(
            block_size=config.block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=config.num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.asynchronous = config.async_scheduling
        # EngineCore's batch queue (async scheduling): (scheduler output, model output).
        self.batch_queue: deque[tuple[Any, Any]] = deque()
        scheduler_cls = AsyncScheduler if self.asynchronous else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=config.block_size,
            log_stats=True,
        )
        self.recorder = _Recorder()
        self.scheduler.kv_event_publisher = self.recorder
        self.preempted: list[str] = []
        wrapped = self.scheduler._preempt_request

        def preempt(request: Any, *args: Any, **kwargs: Any) -> None:
            self.preempted.append(request.request_id)
            wrapped(request, *args, **kwargs)

        self.scheduler._preempt_request = preempt
        self.arrivals = 0
        # Pauses waiting for the engine to go idle (their `clear_cache`), EngineCore's
        # idle callbacks.
        self.pending_pauses: list[bool] = []
        self.hasher: Callable[[Any], Any] | None = None
        if config.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(
                config.block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
            )

    def _request(self, request: ScenarioRequest) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=request.max_tokens,
            ignore_eos=True,
            stop_token_ids=list(request.stop_token_ids),
            min_tokens=request.min_tokens,
            extra_args=None
            if request.kv_cache_report_mode == "incremental"
            else {"kv_cache_report_mode": request.kv_cache_report_mode},
        )
        # Arrival times increase as the frontend's clock would: the priority policy's
        # tie-break between equal priorities.
        self.arrivals += 1
        return Request(
            request_id=request.id,
            prompt_token_ids=list(request.prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(self.arrivals),
            block_hasher=self.hasher,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=None
            if request.lora is None
            else LoRARequest(request.lora.name, request.lora.int_id, request.lora.path),
        )

    def _token(self, request_id: str, position: int) -> int:
        tokens = self.job.output_tokens.get(request_id, [])
        return tokens[position] if position < len(tokens) else fallback_token(request_id, position)

    def run(self) -> Trace:
        scenario: Scenario = self.job.scenario
        arrivals = scenario.arrivals()
        last_arrival = scenario.last_event()
        scheduler = self.scheduler
        trace = Trace(scenario=scenario.name)
        index = 0
        # A pause waiting to complete keeps EngineCore stepping until it is idle.
        while (
            index <= last_arrival or scheduler.get_num_unfinished_requests() or self.pending_pauses
        ):
            if index >= MAX_STEPS:
                trace.error = f"still busy after {MAX_STEPS} steps"
                break
            commanded: list[str] = []
            self.preempted = commanded
            for control in scenario.controls_at(index):
                self._control(control)
            for request in arrivals.get(index, []):
                scheduler.add_request(self._request(request))
            if self._idle_while_paused():
                step = self._close(Step(index=index))
            else:
                run_step = self._async_step if self.asynchronous else self._step
                step = run_step(index, trace.output_tokens)
            step.preempted[:0] = commanded
            if self.pending_pauses:
                self.preempted = step.preempted
                self._complete_pauses()
                step.running, step.waiting = scheduler.get_request_counts()
                step.events += self.recorder.events
                self.recorder.events = []
            trace.steps.append(step)
            index += 1
        return trace

    def _control(self, control: Control) -> None:
        """EngineCoreProc's `pause_generation`, `resume_scheduler` or `abort_requests`."""
        from vllm.v1.core.sched.interface import PauseState
        from vllm.v1.request import RequestStatus

        scheduler = self.scheduler
        if control.kind == "abort":
            # EngineCore's `abort_requests`, one client's request at a time.
            for request_id in control.request_ids:
                scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            return
        if control.kind in ("resume", "wake_up"):
            # wake_up(["kv_cache"]) once nothing else sleeps: `resume_scheduler`.
            scheduler.set_pause_state(PauseState.UNPAUSED)
            return
        if control.kind in ("reset_running", "release"):
            # `release_kv_cache_memory` after its check (a completed pause): `_reset_caches`,
            # then the executor discards the KV cache (nothing to model here).
            if control.kind == "release":
                paused = scheduler.pause_state != PauseState.UNPAUSED
                assert paused and not self._has_work() and not self.pending_pauses
            assert scheduler.reset_prefix_cache(
                reset_running_requests=True, reset_connector=control.kind == "release"
            )
            self.recorder.publish(SimpleNamespace(events=scheduler.kv_cache_manager.take_events()))
            return
        if control.mode == "abort":
            scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        keep = control.mode == "keep"
        scheduler.set_pause_state(PauseState.PAUSED_ALL if keep else PauseState.PAUSED_NEW)
        if self._has_work():
            self.pending_pauses.append(control.clear_cache)
        else:
            self._finish_pause(control.clear_cache)

    def _finish_pause(self, clear_cache: bool) -> None:
        """EngineCore's `_finish_pause`: `_reset_caches` with `clear_cache`. Its KV events
        are recorded when they happen (vLLM publishes them with the next step's output;
        engined when they happen, as for any command)."""
        if clear_cache:
            scheduler = self.scheduler
            assert scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            self.recorder.publish(SimpleNamespace(events=scheduler.kv_cache_manager.take_events()))

    def _has_work(self) -> bool:
        """EngineCore's `has_work()`: the scheduler's requests, or a batch in flight."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def _idle_while_paused(self) -> bool:
        from vllm.v1.core.sched.interface import PauseState

        paused = self.scheduler.pause_state != PauseState.UNPAUSED or self.pending_pauses
        return bool(paused) and not self._has_work()

    def _complete_pauses(self) -> None:
        """EngineCore's idle callbacks, once a step left the engine without work."""
        while self.pending_pauses and not self._has_work():
            self._finish_pause(self.pending_pauses.pop())

    def _step(self, index: int, generated: dict[str, list[int]]) -> Step:
        """One `EngineCore.step()` with fabricated model output; `generated` gains the
        step's output tokens."""
        step = Step(index=index)
        output, runner_output = self._schedule(step)
        self._update(step, output, runner_output, generated)
        return self._close(step)

    def _async_step(self, index: int, generated: dict[str, list[int]]) -> Step:
        """One `EngineCore.step_with_batch_queue()` (batch queue of 2) with fabricated
        model output; `generated` gains the tokens of the batch it updates from, if any."""
        scheduler = self.scheduler
        queue = self.batch_queue
        step = Step(index=index)
        if scheduler.has_requests():
            output, runner_output = self._schedule(step)
            queue.appendleft((output, runner_output))
            ran = output.total_num_scheduled_tokens > 0
            if len(queue) < 2 and (ran or scheduler.has_requests()):
                return self._close(step)
        elif not queue:
            return self._close(step)
        output, runner_output = queue.pop()
        self._update(step, output, runner_output, generated)
        return self._close(step)

    def _schedule(self, step: Step) -> tuple[Any, Any]:
        """`schedule()`, recorded into `step`, and the model output it will get: one token
        for every scheduled request that samples (not mid-prefill), the token engined drew
        for the output position it will take."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        waiting_before = {
            rid for rid, req in scheduler.requests.items() if req.status.name != "RUNNING"
        }
        self.preempted = step.preempted
        output = scheduler.schedule()
        computed_before = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: list[list[int]] = []
        for rid, count in output.num_scheduled_tokens.items():
            computed = computed_before[rid]
            step.scheduled.append(Scheduled(rid, computed, count))
            if rid in waiting_before:
                step.admitted.append(Admitted(rid, computed))
            request = scheduler.requests[rid]
            # Async: the output placeholders (this batch's included) stand for the tokens
            # still to be sampled; the position of this batch's is the last of them.
            pending = request.num_output_placeholders
            position = len(request.output_token_ids) + max(pending - 1, 0)
            samples = not request.is_prefill_chunk
            burst = 1 if samples else 0
            drafts = self.drafts
            if drafts is not None:
                # MTP: after what the batches in flight will deliver, as many as engined gave.
                position = len(request.output_token_ids) + drafts.in_flight(rid)
                if samples:
                    burst = drafts.sampled(rid, output.scheduled_spec_decode_tokens.get(rid))
                    drafts.promise(rid, burst)
            sampled.append([self._token(rid, position + k) for k in range(burst)])
        req_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        return output, runner_output

    def _update(
        self, step: Step, output: Any, runner_output: Any, generated: dict[str, list[int]]
    ) -> None:
        """`update_from_output()`, its outputs recorded into `step` and `generated`."""
        if self.drafts is not None:
            self.drafts.settle(runner_output)
        outputs = self.scheduler.update_from_output(output, runner_output)
        if (
            self.drafts is not None
            and not self.asynchronous
            and output.total_num_scheduled_tokens > 0
        ):
            self.drafts.propose(self.scheduler, list(output.num_scheduled_tokens))
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                generated.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.prefill_stats is not None:
                    step.cached.append(
                        CachedReport(out.request_id, out.prefill_stats.num_cached_tokens)
                    )
                if out.finish_reason is not None:
                    step.finished.append(out.request_id)
                if isinstance(out.stop_reason, int):
                    step.stopped.append(StopReport(out.request_id, out.stop_reason))

    def _close(self, step: Step) -> Step:
        """The counts after the step, and the KV events it published."""
        step.running, step.waiting = self.scheduler.get_request_counts()
        step.events = self.recorder.events
        self.recorder.events = []
        return step


def run_jobs(jobs: list[VllmJob]) -> list[Trace]:
    with tempfile.TemporaryDirectory(prefix="parity-llama-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(_TINY_LLAMA, f)
        os.mkdir(os.path.join(model_dir, "mtp"))
        with open(os.path.join(model_dir, "mtp", "config.json"), "w") as f:
            json.dump({**_TINY_LLAMA, **MTP_MODEL}, f)
        traces = []
        for job in jobs:
            try:
                traces.append(VllmRun(job, model_dir).run())
            except Exception:
                traces.append(Trace(scenario=job.scenario.name, error=traceback.format_exc()))
        return traces


def main() -> None:
    jobs = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=list[VllmJob])
    # vLLM logs to stdout: the traces get the real one, everything else goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    traces = run_jobs(jobs)
    out.write(msgspec.msgpack.encode(traces))
    out.flush()


if __name__ == "__main__":
    main()
