"""The command-line spelling of the settings: one `Flag` per key `engined serve` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engined.config.fields import HELP, KEYS


@dataclass(frozen=True, slots=True)
class Flag:
    """One option of `engined serve`: `name` sets the config `key` (dotted for engine keys).

    Its help is the field's description (`HELP`). `engine_help` stands in for engine keys
    whose `EngineArgs` field has none yet: that struct lives in the core, which does not
    describe itself to a command line. Exactly one of the two is set for every flag.
    """

    name: str
    key: str
    engine_help: str | None = None
    metavar_override: str | None = None

    @property
    def help(self) -> str:
        text = HELP.get(self.key, self.engine_help)
        assert text is not None, f"{self.name} has no help"
        return text

    @property
    def section(self) -> Literal["daemon", "engine"]:
        return "engine" if self.key.startswith("engine.") else "daemon"

    @property
    def dest(self) -> str:
        """A Python identifier for the option (`--block-size` -> `block_size`)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """Booleans are `--x/--no-x` switches rather than options taking a value."""
        return KEYS[self.key].kind is bool

    @property
    def negation(self) -> str:
        return "--no-" + self.name.removeprefix("--")

    @property
    def metavar(self) -> str:
        if self.metavar_override is not None:
            return self.metavar_override
        shape = KEYS[self.key]
        if shape.choices:
            return "[" + "|".join(shape.choices) + "]"
        return {bool: "BOOL", int: "INT", float: "FLOAT", tuple: "INT,..."}.get(shape.kind, "TEXT")


_ENDPOINT = "ENDPOINT"

# Spellings follow vLLM and Dynamo's mocker where they have one (`--data-parallel-size`,
# `--nextn`); the rest are the key with dashes. Daemon flags take their help from the
# `DaemonConfig` field; engine flags carry it here until `EngineArgs` describes its fields.
FLAGS: tuple[Flag, ...] = (
    # NOTE: sglang is an EngineType (mocker configs name it) but no core simulates it.
    Flag(
        "--engine-type",
        "engine.engine_type",
        "Engine whose scheduler is simulated.",
        "[vllm|trtllm]",
    ),
    Flag(
        "--worker-type",
        "engine.worker_type",
        "Aggregated, or one side of disaggregation.",
    ),
    Flag("--num-gpu-blocks", "engine.num_gpu_blocks", "KV cache blocks per rank."),
    Flag(
        "--block-size",
        "engine.block_size",
        "Tokens per KV block (0 = engine default: vllm 64, trtllm 32, sglang 1).",
    ),
    Flag(
        "--max-num-seqs",
        "engine.max_num_seqs",
        'Running requests per rank ("" = no limit).',
    ),
    Flag(
        "--max-num-batched-tokens",
        "engine.max_num_batched_tokens",
        'Token budget of one pass ("" = no limit).',
    ),
    Flag(
        "--max-model-len",
        "engine.max_model_len",
        "Longest prompt + output (vllm only).",
    ),
    Flag(
        "--enable-prefix-caching",
        "engine.enable_prefix_caching",
        "Reuse cached KV blocks of shared prefixes.",
    ),
    Flag(
        "--enable-chunked-prefill",
        "engine.enable_chunked_prefill",
        "Split long prefills across passes.",
    ),
    Flag(
        "--preemption-mode",
        "engine.preemption_mode",
        "Which running request is preempted.",
    ),
    Flag(
        "--speedup-ratio",
        "engine.speedup_ratio",
        "Wall time = modeled time / ratio; 0 runs as fast as the CPU allows.",
    ),
    Flag(
        "--decode-speedup-ratio",
        "engine.decode_speedup_ratio",
        "Extra speedup of decode.",
    ),
    Flag("--data-parallel-size", "engine.dp_size", "Data-parallel ranks (one core each)."),
    Flag(
        "--kv-bytes-per-token",
        "engine.kv_bytes_per_token",
        "KV size per token, for transfers.",
    ),
    Flag(
        "--kv-transfer-bandwidth",
        "engine.kv_transfer_bandwidth",
        "KV transfer bandwidth in GB/s (disaggregated handoff delay).",
    ),
    Flag(
        "--kv-transfer-timing-mode",
        "engine.kv_transfer_timing_mode",
        "Which prompt tokens a handoff transfer is timed for.",
    ),
    Flag("--nextn", "engine.aic_nextn", "MTP draft tokens per step (1..5)."),
    Flag(
        "--nextn-accept-rates",
        "engine.aic_nextn_accept_rates",
        'Accept rate per draft position, comma-separated (e.g. "0.85,0.3").',
    ),
    Flag("--mtp-seed", "engine.aic_mtp_seed", "Seed of MTP acceptance sampling."),
    Flag("--seed", "engine.seed", "Seed of generated output tokens."),
    Flag(
        "--vocab-size",
        "engine.vocab_size",
        'Generated ids are drawn from [0, N), so a tokenizer can decode them ("" = raw u32).',
    ),
    Flag(
        "--excluded-token-ids",
        "engine.excluded_token_ids",
        'Ids never generated (EOS, special tokens), comma-separated (e.g. "0,1,2").',
    ),
    Flag(
        "--prefix-hit-rule",
        "engine.prefix_hit_rule",
        "vllm: a fully cached prompt recomputes its last block; mocker-1.3.0: it computes nothing.",
    ),
    Flag("--perf-model", "engine.perf_model", "Pass timing model."),
    Flag(
        "--fixed-prefill-ms-per-token",
        "engine.fixed_prefill_ms_per_token",
        "Fixed model: prefill cost per token (ms).",
    ),
    Flag(
        "--fixed-pass-overhead-ms",
        "engine.fixed_pass_overhead_ms",
        "Fixed model: cost of every pass (ms).",
    ),
    Flag(
        "--fixed-decode-ms-per-pass",
        "engine.fixed_decode_ms_per_pass",
        "Fixed model: cost of a pass with decodes (ms).",
    ),
    Flag(
        "--handoff-session-timeout-ms",
        "engine.handoff_session_timeout_ms",
        "A held source not released, or a destination not activated, is cancelled after this.",
    ),
    Flag(
        "--num-g2-blocks",
        "engine.num_g2_blocks",
        'Host (G2) KV tier blocks per rank; needs --kv-bytes-per-token ("" = off).',
    ),
    Flag(
        "--num-g3-blocks",
        "engine.num_g3_blocks",
        'Disk (G3) KV tier blocks, staged through G2 ("" = off).',
    ),
    Flag(
        "--offload-batch-size",
        "engine.offload_batch_size",
        "Blocks per G1->G2 transfer.",
    ),
    Flag("--bandwidth-g1-to-g2-gbps", "engine.bandwidth_g1_to_g2_gbps", "GPU->host GB/s."),
    Flag("--bandwidth-g2-to-g1-gbps", "engine.bandwidth_g2_to_g1_gbps", "Host->GPU GB/s."),
    Flag(
        "--bandwidth-g2-to-g3-gbps",
        "engine.bandwidth_g2_to_g3_gbps",
        "Host->disk GB/s.",
    ),
    Flag(
        "--bandwidth-g3-to-g2-gbps",
        "engine.bandwidth_g3_to_g2_gbps",
        "Disk->host GB/s.",
    ),
    Flag("--model-name", "model_name"),
    Flag("--control-endpoint", "control_endpoint", None, _ENDPOINT),
    Flag("--kv-events-endpoint", "kv_events_endpoint", None, _ENDPOINT),
    Flag("--kv-events-connect", "kv_events_connect"),
    Flag("--kv-replay-endpoint", "kv_replay_endpoint", None, _ENDPOINT),
    Flag("--kv-replay-buffer", "kv_replay_buffer"),
    Flag("--kv-replay-client-bytes", "kv_replay_client_bytes"),
    Flag("--kv-events-buffer-bytes", "kv_events_buffer_bytes"),
    Flag("--kv-events-topic", "kv_events_topic"),
    Flag("--kv-events-format", "kv_events_format"),
    Flag("--fpm-endpoint", "fpm_endpoint", None, _ENDPOINT),
    Flag("--worker-id", "worker_id"),
    Flag("--max-queued-requests", "max_queued_requests"),
    Flag("--drain-timeout", "drain_timeout"),
    Flag("--log-format", "log_format"),
    Flag("--log-level", "log_level"),
    Flag("--http-port", "http_port"),
    Flag("--http-host", "http_host"),
)
FLAG_OF_KEY: dict[str, Flag] = {flag.key: flag for flag in FLAGS}
assert len(FLAG_OF_KEY) == len(FLAGS), "two flags set the same key"
assert all(flag.key in KEYS for flag in FLAGS), "a flag names no scalar key"
assert all((flag.key in HELP) != (flag.engine_help is not None) for flag in FLAGS), (
    "a flag's help is declared twice, or nowhere"
)
