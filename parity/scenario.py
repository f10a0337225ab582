"""What both sides run: an engine configuration and a request stream, in steps.

Plain msgspec Structs over the stdlib, so the vLLM side (which cannot import engined) reads
the same definitions the engined side does.
"""

from __future__ import annotations

import msgspec

# A side still busy after this many steps has livelocked (both sides stop there).
MAX_STEPS = 20_000


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """The settings both schedulers get. `num_gpu_blocks` is the same number on both sides:
    vLLM keeps one of them as its null block, which is one of the differences to find."""

    block_size: int = 16
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    # vLLM's --scheduling-policy, --scheduler-reserve-full-isl, --prefix-caching-hash-algo.
    scheduling_policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # vLLM's AsyncScheduler, driven as EngineCore drives it (`step_with_batch_queue`).
    async_scheduling: bool = False
    # vLLM's --long-prefill-token-threshold and --long-prefill-token-threshold-adaptive.
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    # vLLM's --watermark: the fraction of the pool an admission leaves free.
    watermark: float = 0.0
    # vLLM's --max-num-active-seqs: the requests admitted into running (None: max_num_seqs).
    max_num_active_seqs: int | None = None
    # vLLM's --max-num-scheduled-tokens: the tokens one step schedules (None: the budget).
    max_num_scheduled_tokens: int | None = None
    # vLLM's --prefill-schedule-interval: prefill every N steps while requests decode.
    prefill_schedule_interval: int = 1
    # vLLM's --enable-lora and --max-loras (its `LoRAConfig`).
    enable_lora: bool = False
    max_loras: int = 1
    # engined only: draw output tokens from [0, vocab_size), so stop ids come up (vLLM samples
    # nothing: it is given engined's tokens).
    vocab_size: int | None = None
    # MTP: vLLM's `--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'`,
    # engined's `--nextn N` (0: none); and engined's acceptance rates per draft position
    # (vLLM accepts what engined accepted: `VllmJob.bursts`).
    num_speculative_tokens: int = 0
    mtp_accept_rates: str = "0.8,0.6,0.4"
    # vLLM's speculative method: `mtp` (lookahead block hashes) or `draft_model` (a draft
    # model beside the target, the tiny Llama for both: plain hashes, engined's
    # `lookahead_block_hashes = false`).
    speculative_method: str = "mtp"
    # vLLM's `disable_lookahead_block_hashes` (with `mtp`): plain hashes and its EAGLE
    # trailing-block drop of a prefix hit (engined's `eagle_block_drop`).
    disable_lookahead_block_hashes: bool = False


class Adapter(msgspec.Struct, frozen=True, array_like=True):
    """A request's LoRA adapter, vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

    name: str
    int_id: int
    path: str


class ScenarioRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request, submitted before the step `arrival` (0-based) is scheduled."""

    id: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    # vLLM's request priority (lower first under the priority policy).
    priority: int = 0
    # vLLM's `SamplingParams.stop_token_ids` and `min_tokens`, and the request's `cache_salt`.
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    cache_salt: str | None = None
    # Its LoRA adapter (None: the base model).
    lora: Adapter | None = None
    # engined's planned output (its length is `max_tokens`); vLLM is given it as engined's
    # tokens, like any other.
    output_token_ids: list[int] | None = None
    # vLLM's `SamplingParams.extra_args["kv_cache_report_mode"]` ("full": its prefix hits
    # are published again).
    kv_cache_report_mode: str = "incremental"


class Control(msgspec.Struct, frozen=True, kw_only=True):
    """An EngineCore call before the arrivals of step `step` (0-based): `pause`
    (`pause_generation(mode, clear_cache)`), `resume` (`resume_scheduler`), `reset_running`
    (`reset_prefix_cache(reset_running_requests=True)`), `release`
    (`release_kv_cache_memory()`), `wake_up` (`wake_up(["kv_cache"])`) or `abort`
    (`abort_requests([id])` for each of `request_ids` in order, as a client's disconnect
    reaches EngineCore: engined's `Cancel`)."""

    step: int
    kind: str
    mode: str = "abort"
    clear_cache: bool = True
    request_ids: list[str] = []


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    config: Config
    requests: list[ScenarioRequest]
    # One line for the parity table.
    description: str = ""
    # Pauses and resumes, in step order.
    controls: list[Control] = []

    def last_event(self) -> int:
        """The last step with an arrival or a control (-1: none): both sides run past it."""
        return max([r.arrival for r in self.requests] + [c.step for c in self.controls] + [-1])

    def controls_at(self, step: int) -> list[Control]:
        return [c for c in self.controls if c.step == step]

    def arrivals(self) -> dict[int, list[ScenarioRequest]]:
        """The requests by arrival step, each step's in scenario order."""
        by_step: dict[int, list[ScenarioRequest]] = {}
        for request in self.requests:
            by_step.setdefault(request.arrival, []).append(request)
        return by_step


class VllmJob(msgspec.Struct, frozen=True, kw_only=True):
    """A scenario for the vLLM side, with the output tokens engined drew for each request by
    position: vLLM samples nothing, so it is given the same tokens (they feed block hashes
    and the events' token ids)."""

    scenario: Scenario
    output_tokens: dict[str, list[int]]
    # With MTP: how many tokens each of a request's sampling steps gave on engined's side
    # (1 + the drafts it accepted), in order; vLLM's model output gives as many.
    bursts: dict[str, list[int]] = {}


def fallback_token(request_id: str, position: int) -> int:
    """The token for a position engined never produced (a side generating longer than the
    other): deterministic, so a rerun gives the same trace."""
    return (sum(request_id.encode()) * 31 + position) % 32000 + 1


def asynchronous(scenario: Scenario) -> Scenario:
    """`scenario` under vLLM's AsyncScheduler (`<name>-async`)."""
    return msgspec.structs.replace(
        scenario,
        name=scenario.name + "-async",
        description=scenario.description + "; async scheduling",
        config=msgspec.structs.replace(scenario.config, async_scheduling=True),
    )
