"""vLLM 0.33's Prometheus families as data, and the histogram engined fills for them.

Names, help texts, label names and bucket boundaries are vLLM's (`vllm/v1/metrics/loggers.py`,
`buckets.py`, `stats.py`, `cache_hit_source.py`, `vllm/v1/spec_decode/metrics.py`), written
out here once so that the collector (engined.server.ops.prometheus_metrics) and the tests read one
table.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Literal

from prometheus_client.utils import floatToGoString

# Every series' labels: the served model name and the data-parallel rank, as vLLM labels the
# engine cores of one API server.
LABELS: Final = ("model_name", "engine")

# --- bucket boundaries (vllm/v1/metrics/buckets.py) -----------------------------------------

TTFT_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Inter-token latency and the per-request time per output token.
ITL_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# The request phases: e2e, queue, inference, prefill, decode.
REQUEST_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS: Final[tuple[float, ...]] = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS: Final[tuple[float, ...]] = (1, 2, 3, 4, 5, 10, 20)
KV_CACHE_RESIDENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30,
    60, 120, 300, 600, 1200, 1800,
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """The token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_model_len` inclusive."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


# --- label values -------------------------------------------------------------------------------

# vLLM's `FinishReason`, every value exposed from the start (at 0), as vLLM pre-creates them.
# The core's reasons map onto them: length and stop as such, rejected and cancelled as abort.
FINISHED_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
# `PromptTokenStats.ALL_SOURCES`: where a request's prompt KV came from.
PROMPT_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
# `CacheHitSource`: the cache tier that supplied cached prompt tokens.
CACHE_HIT_SOURCES: Final = ("device", "host", "p2p", "disk", "external_unspecified")
WAITING_REASONS: Final = ("capacity", "deferred")
KV_FETCH_STAGES: Final = ("waiting_to_start", "in_progress", "completed_waiting")
SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")
ADMISSION_REASONS: Final = ("max_num_queued_reqs", "max_num_queued_tokens")

# --- families -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: its name, type, help text and label names, as vLLM declares it."""

    name: str
    kind: Literal["gauge", "counter", "histogram"]
    documentation: str
    labels: tuple[str, ...] = LABELS


def _with(label: str) -> tuple[str, ...]:
    return (*LABELS, label)


RUNNING: Final = Family(
    "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."
)
WAITING: Final = Family(
    "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."
)
WAITING_BY_REASON: Final = Family(
    "vllm:num_requests_waiting_by_reason",
    "gauge",
    "Number of waiting requests by reason. "
    "Reason labels: 'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints "
    "(LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting.",
    _with("reason"),
)
KV_FETCH_BY_STAGE: Final = Family(
    "vllm:num_requests_kv_fetch_by_stage",
    "gauge",
    "Number of waiting requests by async KV load stage. "
    "Stage labels: 'waiting_to_start' = needs an async KV load "
    "that has not started; 'in_progress' = load started and not "
    "yet reported finished; 'completed_waiting' = load finished, "
    "request not running yet.",
    _with("stage"),
)
SLEEP_STATE: Final = Family(
    "vllm:engine_sleep_state",
    "gauge",
    "Engine sleep state; awake = 0 means engine is sleeping; "
    "awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; "
    "discard_all = 1 means sleep level 2.",
    _with("sleep_state"),
)
KV_CACHE_USAGE: Final = Family(
    "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."
)
# engined's own name (vLLM has no such series); `vllm:kv_cache_usage_perc` stays the GPU pool's.
TIER_BLOCKS: Final = Family(
    "engined:kv_tier_blocks",
    "gauge",
    "KV blocks of the offload tiers (g2: host memory, g3: disk) by state.",
    (*LABELS, "tier", "state"),
)
PREFIX_CACHE_QUERIES: Final = Family(
    "vllm:prefix_cache_queries",
    "counter",
    "Prefix cache queries, in terms of number of queried tokens.",
)
PREFIX_CACHE_HITS: Final = Family(
    "vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."
)
EXTERNAL_PREFIX_CACHE_QUERIES: Final = Family(
    "vllm:external_prefix_cache_queries",
    "counter",
    "External prefix cache queries from KV connector "
    "cross-instance cache sharing, in terms of number of queried tokens.",
)
EXTERNAL_PREFIX_CACHE_HITS: Final = Family(
    "vllm:external_prefix_cache_hits",
    "counter",
    "External prefix cache hits from KV connector "
    "cross-instance cache sharing, in terms of number of cached tokens.",
)
NUM_PREEMPTIONS: Final = Family(
    "vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."
)
PROMPT_TOKENS: Final = Family(
    "vllm:prompt_tokens", "counter", "Number of prefill tokens processed."
)
PROMPT_TOKENS_BY_SOURCE: Final = Family(
    "vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.", _with("source")
)
PROMPT_TOKENS_CACHED: Final = Family(
    "vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external)."
)
PROMPT_TOKENS_CACHED_BY_SOURCE: Final = Family(
    "vllm:prompt_tokens_cached_by_source",
    "counter",
    "Prefix-cache hit tokens by the cache tier that supplied them: "
    "device (local HBM), host (offloaded to DRAM), disk, p2p "
    "(transferred from another vLLM instance) or "
    "external_unspecified. Counted at admission; sums to "
    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
    _with("source"),
)
GENERATION_TOKENS: Final = Family(
    "vllm:generation_tokens", "counter", "Number of generation tokens processed."
)
REQUEST_SUCCESS: Final = Family(
    "vllm:request_success",
    "counter",
    "Count of successfully processed requests.",
    _with("finished_reason"),
)
# The API server's, per model: no `engine` label.
ADMISSION_REJECTIONS: Final = Family(
    "vllm:admission_rejections",
    "counter",
    "Number of admission attempts rejected by a queue limit, by reason.",
    ("model_name", "reason"),
)
# vLLM's, with `--enable-lora` only: one series per set of adapters in use, valued the Unix
# time it was last current (engined.server.ops.prometheus_lora); no model or engine label.
LORA_REQUESTS_INFO: Final = Family(
    "vllm:lora_requests_info",
    "gauge",
    "Running stats on lora requests.",
    ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
)
SPEC_DECODE_NUM_DRAFTS: Final = Family(
    "vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."
)
SPEC_DECODE_NUM_DRAFT_TOKENS: Final = Family(
    "vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS: Final = Family(
    "vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS: Final = Family(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "counter",
    "Accepted tokens per draft position.",
    _with("position"),
)
CACHE_CONFIG_INFO_NAME: Final = "vllm:cache_config_info"
CACHE_CONFIG_INFO_HELP: Final = "Information of the LLMEngine CacheConfig"


def _histogram(name: str, documentation: str) -> Family:
    return Family(name, "histogram", documentation)


# Every histogram, in vLLM's order, with the `RankMetrics` attribute holding its tallies.
HISTOGRAMS: Final[tuple[tuple[Family, str], ...]] = (
    (
        _histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
        "request_prompt",
    ),
    (
        _histogram("vllm:request_generation_tokens", "Number of generation tokens processed."),
        "request_generation",
    ),
    (
        _histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."),
        "iteration",
    ),
    (
        _histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
        ),
        "max_generation",
    ),
    (_histogram("vllm:request_params_n", "Histogram of the n request parameter."), "params_n"),
    (
        _histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."
        ),
        "params_max_tokens",
    ),
    (
        _histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."
        ),
        "ttft",
    ),
    (
        _histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."
        ),
        "itl",
    ),
    (
        _histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
        ),
        "tpot",
    ),
    (
        _histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        ),
        "e2e",
    ),
    (
        _histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        ),
        "queue",
    ),
    (
        _histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        ),
        "inference",
    ),
    (
        _histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        ),
        "prefill",
    ),
    (
        _histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        ),
        "decode",
    ),
    (
        _histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
        ),
        "preemptions",
    ),
    (
        _histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        ),
        "prefill_computed",
    ),
)
_SAMPLED: Final = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
# `--kv-cache-metrics` only.
RESIDENCY_HISTOGRAMS: Final[tuple[tuple[Family, str], ...]] = (
    (
        _histogram(
            "vllm:kv_block_lifetime_seconds",
            "Histogram of KV cache block lifetime from allocation to eviction. " + _SAMPLED,
        ),
        "block_lifetime",
    ),
    (
        _histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction. " + _SAMPLED,
        ),
        "block_idle",
    ),
    (
        _histogram(
            "vllm:kv_block_reuse_gap_seconds",
            "Histogram of time gaps between consecutive KV cache block "
            "accesses. Only the most recent accesses are recorded "
            "(ring buffer). " + _SAMPLED,
        ),
        "block_reuse_gap",
    ),
)

# --- the histogram ------------------------------------------------------------------------------

# How prometheus_client's own Histogram spells `le` ("0.001", "1.0"); typed here, untyped there.
_go_float: Callable[[float], str] = floatToGoString
_LES: dict[tuple[float, ...], tuple[str, ...]] = {}


class LatencyHistogram:
    """A Prometheus histogram as plain bucket counts, filled with `add(value, count)`.

    Exists because `prometheus_client.Histogram.observe` takes one sample per call (under a
    lock), and a pass wants to add "N requests waited X seconds" in one step. Despite the
    name it holds any histogram (token counts too); the name is older than those.
    """

    __slots__ = ("bounds", "count", "counts", "les", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds: tuple[float, ...] = tuple(bounds)
        # Spelled once per set of bounds, not at every scrape.
        les = _LES.get(self.bounds)
        if les is None:
            les = _LES[self.bounds] = (*(_go_float(b) for b in self.bounds), "+Inf")
        self.les = les
        # counts[i]: samples in (bounds[i-1], bounds[i]]; the last slot is (bounds[-1], +Inf).
        self.counts: list[int] = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float, count: int = 1) -> None:
        """Record `count` samples equal to `value` (le semantics: value <= bound)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.count += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """Buckets as the exposition wants them: (le, cumulative count), ending with +Inf."""
        return list(zip(self.les, map(float, accumulate(self.counts)), strict=True))
