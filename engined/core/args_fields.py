"""The fields of `EngineArgs`: every engine key, its type, default and description.

Declared apart from the rules that normalise and validate them (`engined.core.args_rules`) so
that each field carries its own description: the daemon's `engined serve --help` reads it from
here, and a new key is documented where it is declared. The descriptions are plain
`msgspec.Meta` metadata; the core itself never reads them.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from engined.core.types import KvTransferTimingMode
from engined.core.vllm_hashing import DEFAULT_HASH_ALGO, HashAlgo


class EngineType(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


class WorkerType(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class PreemptionMode(enum.StrEnum):
    LIFO = "lifo"
    FIFO = "fifo"


class PerfModelKind(enum.StrEnum):
    POLYNOMIAL = "polynomial"
    FIXED = "fixed"


class PrefixHitRule(enum.StrEnum):
    """How much of a cached prompt counts as a prefix hit (engined/core/prefix_hit.py)."""

    # vLLM's `get_computed_blocks` (and later upstream mocker): the hit stops one token short
    # of the known sequence, in whole blocks, so a fully cached prompt recomputes its last block.
    VLLM = "vllm"
    # dynamo-mocker 1.3.0: every cached block is a hit, even when that leaves nothing to compute.
    MOCKER_1_3_0 = "mocker-1.3.0"


class Semantics(enum.StrEnum):
    """Whose scheduling and KV-cache rules the vLLM core follows (README "Faithfulness")."""

    # vLLM 0.33's v1 scheduler and KV cache manager (engined/core/paged/), checked step by
    # step against the real one (parity/).
    VLLM = "vllm"
    # Dynamo's mocker 1.3.0 (the lineage pool, eager allocation): the seed suite's world.
    MOCKER_1_3_0 = "mocker-1.3.0"


class SchedulingPolicy(enum.StrEnum):
    """vLLM's `--scheduling-policy` (vLLM semantics only)."""

    FCFS = "fcfs"
    # Waiting requests by (priority, arrival), lower first; the victim of a preemption is the
    # running request with the greatest (priority, arrival).
    PRIORITY = "priority"


class TrtllmArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capacity_scheduler_policy: str | None = None


class SglangArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schedule_policy: str | None = None
    page_size: int | None = None
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    clip_max_new_tokens: int | None = None
    schedule_conservativeness: float | None = None


class EngineFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The declarations of `EngineArgs`, which adds loading and normalisation; use that.

    Keys after `trtllm`/`sglang` that the core never reads are kept so a Dynamo mocker JSON
    loads without edits. Only keys with an `engined serve` flag have a description.
    """

    engine_type: Annotated[EngineType, Meta(description="Engine whose scheduler is simulated.")] = (
        EngineType.VLLM
    )
    num_gpu_blocks: Annotated[int, Meta(description="KV cache blocks per rank.")] = 16384
    block_size: Annotated[
        int,
        Meta(description="Tokens per KV block (0 = engine default: vllm 64, trtllm 32, sglang 1)."),
    ] = 0
    max_num_seqs: (
        Annotated[int, Meta(description='Running requests per rank ("" = no limit).')] | None
    ) = 256
    max_num_batched_tokens: (
        Annotated[int, Meta(description='Token budget of one pass ("" = no limit).')] | None
    ) = 8192
    enable_prefix_caching: Annotated[
        bool, Meta(description="Reuse cached KV blocks of shared prefixes.")
    ] = True
    enable_chunked_prefill: Annotated[
        bool, Meta(description="Split long prefills across passes.")
    ] = True
    speedup_ratio: Annotated[
        float,
        Meta(description="Wall time = modeled time / ratio; 0 runs as fast as the CPU allows."),
    ] = 1.0
    decode_speedup_ratio: Annotated[float, Meta(description="Extra speedup of decode.")] = 1.0
    dp_size: Annotated[int, Meta(description="Data-parallel ranks (one core each).")] = 1
    startup_time: float | None = None
    worker_type: Annotated[
        WorkerType, Meta(description="Aggregated, or one side of disaggregation.")
    ] = WorkerType.AGGREGATED
    preemption_mode: Annotated[
        PreemptionMode, Meta(description="Which running request is preempted.")
    ] = PreemptionMode.LIFO
    max_model_len: (
        Annotated[int, Meta(description="Longest prompt + output (vllm only).")] | None
    ) = None
    aic_nextn: Annotated[int, Meta(description="MTP draft tokens per step (1..5).")] | None = None
    aic_nextn_accept_rates: (
        Annotated[
            str,
            Meta(description='Accept rate per draft position, comma-separated (e.g. "0.85,0.3").'),
        ]
        | None
    ) = None
    aic_mtp_seed: Annotated[int, Meta(description="Seed of MTP acceptance sampling.")] = 42
    kv_bytes_per_token: (
        Annotated[int, Meta(description="KV size per token, for transfers.")] | None
    ) = None
    kv_transfer_bandwidth: (
        Annotated[
            float, Meta(description="KV transfer bandwidth in GB/s (disaggregated handoff delay).")
        ]
        | None
    ) = None
    kv_transfer_timing_mode: Annotated[
        KvTransferTimingMode,
        Meta(description="Which prompt tokens a handoff transfer is timed for."),
    ] = KvTransferTimingMode.FULL_PROMPT
    handoff_session_timeout_ms: Annotated[
        int,
        Meta(
            description="A held source not released, or a destination not activated, "
            "is cancelled after this."
        ),
    ] = 300000
    num_g2_blocks: (
        Annotated[
            int,
            Meta(
                description="Host (G2) KV tier blocks per rank; "
                'needs --kv-bytes-per-token ("" = off).'
            ),
        ]
        | None
    ) = None
    num_g3_blocks: (
        Annotated[int, Meta(description='Disk (G3) KV tier blocks, staged through G2 ("" = off).')]
        | None
    ) = None
    enable_g4_storage: bool = False
    offload_batch_size: Annotated[int, Meta(description="Blocks per G1->G2 transfer.")] | None = (
        None
    )
    bandwidth_g1_to_g2_gbps: Annotated[float, Meta(description="GPU->host GB/s.")] | None = None
    bandwidth_g2_to_g1_gbps: Annotated[float, Meta(description="Host->GPU GB/s.")] | None = None
    bandwidth_g2_to_g3_gbps: Annotated[float, Meta(description="Host->disk GB/s.")] | None = None
    bandwidth_g3_to_g2_gbps: Annotated[float, Meta(description="Disk->host GB/s.")] | None = None
    bandwidth_g2_to_g4_gbps: float | None = None
    bandwidth_g4_to_g2_gbps: float | None = None
    trtllm: TrtllmArgs | None = None
    sglang: SglangArgs | None = None
    planner_profile_data: str | None = None
    aic_backend: str | None = None
    aic_system: str | None = None
    aic_backend_version: str | None = None
    aic_model_path: str | None = None
    aic_gemm_dtype: str | None = None
    aic_moe_dtype: str | None = None
    aic_fmha_dtype: str | None = None
    aic_kv_cache_dtype: str | None = None
    aic_comm_dtype: str | None = None
    aic_tp_size: int | None = None
    aic_moe_tp_size: int | None = None
    aic_moe_ep_size: int | None = None
    aic_attention_dp_size: int | None = None
    gpu_memory_utilization: float | None = None
    mem_fraction_static: float | None = None
    free_gpu_memory_fraction: float | None = None
    enable_local_indexer: bool = False
    bootstrap_port: int | None = None
    reasoning: dict[str, Any] | None = None
    response_replay_trace_path: str | None = None
    zmq_kv_events_port: int | None = None
    zmq_replay_port: int | None = None
    router_queue_policy: str | None = None
    # engined extensions
    # Also the identities of blocks while prefix caching is off.
    seed: Annotated[int, Meta(description="Seed of generated output tokens.")] = 0
    perf_model: Annotated[PerfModelKind, Meta(description="Pass timing model.")] = (
        PerfModelKind.POLYNOMIAL
    )
    fixed_prefill_ms_per_token: Annotated[
        float, Meta(description="Fixed model: prefill cost per token (ms).")
    ] = 0.02
    fixed_pass_overhead_ms: Annotated[
        float, Meta(description="Fixed model: cost of every pass (ms).")
    ] = 1.0
    fixed_decode_ms_per_pass: Annotated[
        float, Meta(description="Fixed model: cost of a pass with decodes (ms).")
    ] = 10.0
    # Unplanned output ids: uniform in [0, vocab_size) minus excluded_token_ids (engined/core/
    # vocab.py); unset vocab_size keeps raw u32 ids.
    vocab_size: (
        Annotated[
            int,
            Meta(
                description="Generated ids are drawn from [0, N), "
                'so a tokenizer can decode them ("" = raw u32).'
            ),
        ]
        | None
    ) = None
    excluded_token_ids: Annotated[
        tuple[int, ...],
        Meta(
            description='Ids never generated (EOS, special tokens), comma-separated (e.g. "0,1,2").'
        ),
    ] = ()
    prefix_hit_rule: Annotated[
        PrefixHitRule,
        Meta(
            description="vllm: a fully cached prompt recomputes its last block; "
            "mocker-1.3.0: it computes nothing."
        ),
    ] = PrefixHitRule.VLLM
    scheduling_policy: Annotated[
        SchedulingPolicy,
        Meta(
            description="vLLM semantics: fcfs, or priority (waiting requests by their "
            "priority, lower first; preemption takes the lowest-priority running one)."
        ),
    ] = SchedulingPolicy.FCFS
    scheduler_reserve_full_isl: Annotated[
        bool,
        Meta(
            description="vLLM semantics: admit a waiting request only when its whole known "
            "sequence fits the free blocks, not just its first chunk (vLLM's default)."
        ),
    ] = True
    prefill_schedule_interval: Annotated[
        int,
        Meta(
            description="vLLM semantics: prefill (admissions and prompt chunks) only every "
            "N passes while requests decode, unless the last prefill left requests waiting."
        ),
    ] = 1
    max_num_scheduled_tokens: (
        Annotated[
            int,
            Meta(
                description="vLLM semantics: vLLM's cap on the tokens one pass schedules, "
                'below max_num_batched_tokens ("" = max_num_batched_tokens).'
            ),
        ]
        | None
    ) = None
    max_num_active_seqs: (
        Annotated[
            int,
            Meta(
                description="vLLM semantics: vLLM's limit on the requests admitted into "
                'running, at most max_num_seqs ("" = max_num_seqs).'
            ),
        ]
        | None
    ) = None
    watermark: Annotated[
        float,
        Meta(
            description="vLLM semantics: the fraction of KV blocks a waiting or preempted "
            "request must leave free to be admitted while others run, in [0, 1)."
        ),
    ] = 0.0
    long_prefill_token_threshold: Annotated[
        int,
        Meta(
            description="vLLM semantics: vLLM's cap on the tokens one request computes in a "
            "pass while other requests run or wait (0: none)."
        ),
    ] = 0
    long_prefill_token_threshold_adaptive: Annotated[
        bool,
        Meta(
            description="vLLM semantics: floor that cap at max_num_batched_tokens divided "
            "by the running and waiting requests."
        ),
    ] = False
    async_scheduling: Annotated[
        bool,
        Meta(
            description="vLLM semantics: vLLM's AsyncScheduler (a pass schedules with "
            "placeholders for tokens still being sampled; outputs arrive one pass later)."
        ),
    ] = False
    lookahead_block_hashes: Annotated[
        bool,
        Meta(
            description="vLLM semantics, MTP with prefix caching: vLLM's lookahead block "
            "hashes (each covers the token after its block); false: its plain ones, as with "
            "vLLM's draft_model method or disable_lookahead_block_hashes and "
            "disable_eagle_block_drop."
        ),
    ] = True
    eagle_block_drop: Annotated[
        bool,
        Meta(
            description="vLLM semantics, MTP with prefix caching and plain hashes: a prefix "
            "hit gives its last block back to be recomputed, vLLM's EAGLE trailing-block drop "
            "(its disable_lookahead_block_hashes without disable_eagle_block_drop)."
        ),
    ] = False
    drafting_slots: Annotated[
        int,
        Meta(
            description="vLLM semantics, MTP: input slots each scheduled request takes from "
            "max_num_batched_tokens beyond its tokens, vLLM's max_num_new_slots_for_drafting "
            "(1 for its draft_model method, 0 for mtp and eagle)."
        ),
    ] = 0
    enable_lora: Annotated[
        bool,
        Meta(
            description="vLLM semantics: accept requests for LoRA adapters, as vLLM's "
            "--enable-lora (their blocks hash apart; max_loras bounds a pass)."
        ),
    ] = False
    max_loras: Annotated[
        int,
        Meta(
            description="vLLM semantics: the adapters the running requests may use at once; "
            "a waiting request for another waits, as vLLM's --max-loras."
        ),
    ] = 1
    semantics: Annotated[
        Semantics,
        Meta(
            description="vllm: vLLM 0.33's scheduler and KV cache; mocker-1.3.0: Dynamo's "
            "mocker 1.3.0 (also implied by prefix_hit_rule = mocker-1.3.0)."
        ),
    ] = Semantics.VLLM
    kv_cache_metrics: Annotated[
        bool,
        Meta(
            description="vLLM semantics: vLLM's --kv-cache-metrics, KV block residency "
            "histograms (lifetime, idle time before eviction, reuse gaps) on /metrics."
        ),
    ] = False
    kv_cache_metrics_sample: Annotated[
        float,
        Meta(
            description="vLLM's --kv-cache-metrics-sample: the fraction of allocated blocks "
            "kv_cache_metrics follows, in (0, 1]."
        ),
    ] = 0.01
    prefix_caching_hash_algo: Annotated[
        HashAlgo,
        Meta(
            description="vLLM's block hash (sha256, sha256_cbor, xxhash, xxhash_cbor); "
            "NONE_HASH follows PYTHONHASHSEED as in vLLM."
        ),
    ] = DEFAULT_HASH_ALGO
