"""The command-line spelling of the settings: one `Flag` per key `engined serve` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engined.config.fields import HELP, KEYS


@dataclass(frozen=True, slots=True)
class Flag:
    """One option of `engined serve`: `name` sets the config `key` (dotted for engine keys).

    Its help is the description of the key's field (`HELP`), declared once, beside the field
    in `DaemonConfig` or `EngineArgs`.
    """

    name: str
    key: str
    metavar_override: str | None = None
    # Other spellings of the same option: vLLM's names where engined had its own first
    # (`--served-model-name` for `--model-name`), so a `vllm serve` command line runs unchanged.
    aliases: tuple[str, ...] = ()
    # Given once per value (`--model-aliases a --model-aliases b`) for a list of opaque
    # strings, where no separator can be reserved.
    repeated: bool = False
    # vLLM's `nargs="+"` for a list of opaque strings: one or more values follow the flag, up
    # to the next option, and the flag given again replaces them, as vLLM's `--lora-modules`
    # action does (engined.cli.serve reads a command line so).
    many: bool = False

    @property
    def help(self) -> str:
        return HELP[self.key]

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
# `--nextn`); the rest are the key with dashes. The help is the field's description.
FLAGS: tuple[Flag, ...] = (
    # NOTE: sglang is an EngineType (mocker configs name it) but no core simulates it.
    Flag("--engine-type", "engine.engine_type", metavar_override="[vllm|trtllm]"),
    Flag("--worker-type", "engine.worker_type"),
    Flag("--num-gpu-blocks", "engine.num_gpu_blocks", aliases=("--num-gpu-blocks-override",)),
    Flag("--block-size", "engine.block_size"),
    Flag("--max-num-seqs", "engine.max_num_seqs"),
    Flag("--max-num-batched-tokens", "engine.max_num_batched_tokens"),
    Flag("--max-model-len", "engine.max_model_len"),
    Flag("--enable-prefix-caching", "engine.enable_prefix_caching"),
    Flag("--enable-chunked-prefill", "engine.enable_chunked_prefill"),
    Flag("--preemption-mode", "engine.preemption_mode"),
    Flag("--speedup-ratio", "engine.speedup_ratio"),
    Flag("--decode-speedup-ratio", "engine.decode_speedup_ratio"),
    Flag("--data-parallel-size", "engine.dp_size"),
    Flag("--kv-bytes-per-token", "engine.kv_bytes_per_token"),
    Flag("--kv-transfer-bandwidth", "engine.kv_transfer_bandwidth"),
    Flag("--kv-transfer-timing-mode", "engine.kv_transfer_timing_mode"),
    Flag("--nextn", "engine.aic_nextn"),
    Flag("--nextn-accept-rates", "engine.aic_nextn_accept_rates"),
    Flag("--mtp-seed", "engine.aic_mtp_seed"),
    Flag("--seed", "engine.seed"),
    Flag("--vocab-size", "engine.vocab_size"),
    Flag("--excluded-token-ids", "engine.excluded_token_ids"),
    Flag("--prefix-hit-rule", "engine.prefix_hit_rule"),
    Flag("--semantics", "engine.semantics"),
    Flag("--scheduling-policy", "engine.scheduling_policy"),
    Flag("--scheduler-reserve-full-isl", "engine.scheduler_reserve_full_isl"),
    Flag("--async-scheduling", "engine.async_scheduling"),
    Flag("--lookahead-block-hashes", "engine.lookahead_block_hashes"),
    Flag("--drafting-slots", "engine.drafting_slots"),
    Flag("--eagle-block-drop", "engine.eagle_block_drop"),
    Flag("--enable-lora", "engine.enable_lora"),
    Flag("--max-loras", "engine.max_loras"),
    Flag("--long-prefill-token-threshold", "engine.long_prefill_token_threshold"),
    Flag("--watermark", "engine.watermark"),
    Flag("--max-num-active-seqs", "engine.max_num_active_seqs"),
    Flag("--max-num-scheduled-tokens", "engine.max_num_scheduled_tokens"),
    Flag("--prefill-schedule-interval", "engine.prefill_schedule_interval"),
    Flag(
        "--long-prefill-token-threshold-adaptive",
        "engine.long_prefill_token_threshold_adaptive",
    ),
    Flag("--prefix-caching-hash-algo", "engine.prefix_caching_hash_algo"),
    Flag("--kv-cache-metrics", "engine.kv_cache_metrics"),
    Flag("--kv-cache-metrics-sample", "engine.kv_cache_metrics_sample"),
    Flag("--perf-model", "engine.perf_model"),
    Flag("--fixed-prefill-ms-per-token", "engine.fixed_prefill_ms_per_token"),
    Flag("--fixed-pass-overhead-ms", "engine.fixed_pass_overhead_ms"),
    Flag("--fixed-decode-ms-per-pass", "engine.fixed_decode_ms_per_pass"),
    Flag("--handoff-session-timeout-ms", "engine.handoff_session_timeout_ms"),
    Flag("--num-g2-blocks", "engine.num_g2_blocks"),
    Flag("--num-g3-blocks", "engine.num_g3_blocks"),
    Flag("--offload-batch-size", "engine.offload_batch_size"),
    Flag("--bandwidth-g1-to-g2-gbps", "engine.bandwidth_g1_to_g2_gbps"),
    Flag("--bandwidth-g2-to-g1-gbps", "engine.bandwidth_g2_to_g1_gbps"),
    Flag("--bandwidth-g2-to-g3-gbps", "engine.bandwidth_g2_to_g3_gbps"),
    Flag("--bandwidth-g3-to-g2-gbps", "engine.bandwidth_g3_to_g2_gbps"),
    Flag("--model-name", "model_name", aliases=("--served-model-name",)),
    Flag("--control-endpoint", "control_endpoint", metavar_override=_ENDPOINT),
    Flag("--operator-endpoint", "operator_endpoint", metavar_override=_ENDPOINT),
    Flag("--max-connections", "max_connections"),
    Flag("--curve-secret-key-file", "curve_secret_key_file"),
    Flag("--curve-authorized-keys-file", "curve_authorized_keys_file"),
    Flag("--curve-publishers", "curve_publishers"),
    Flag("--kv-events-endpoint", "kv_events_endpoint", metavar_override=_ENDPOINT),
    Flag("--kv-events-connect", "kv_events_connect"),
    Flag("--kv-replay-endpoint", "kv_replay_endpoint", metavar_override=_ENDPOINT),
    Flag("--kv-replay-buffer", "kv_replay_buffer"),
    Flag("--kv-replay-client-bytes", "kv_replay_client_bytes"),
    Flag("--kv-events-buffer-bytes", "kv_events_buffer_bytes"),
    Flag("--kv-events-topic", "kv_events_topic"),
    Flag("--kv-events-format", "kv_events_format"),
    Flag("--fpm-endpoint", "fpm_endpoint", metavar_override=_ENDPOINT),
    Flag("--worker-id", "worker_id"),
    Flag("--max-queued-requests", "max_queued_requests"),
    Flag("--control-inflight-bytes", "control_inflight_bytes"),
    Flag("--control-unread-bytes", "control_unread_bytes"),
    Flag("--drain-timeout", "drain_timeout"),
    Flag("--rank-processes", "rank_processes"),
    Flag("--realtime-priority", "realtime_priority"),
    Flag("--log-format", "log_format"),
    Flag("--log-level", "log_level"),
    Flag("--http-port", "http_port"),
    Flag("--http-host", "http_host"),
    Flag("--api-key", "api_key", metavar_override="KEY"),
    Flag("--api-key-file", "api_key_file", metavar_override="PATH"),
    Flag("--api-key-metrics", "api_key_metrics"),
    Flag("--model", "model", metavar_override="MODEL"),
    Flag("--model-aliases", "model_aliases", metavar_override="NAME", repeated=True),
    Flag("--tokenizer", "tokenizer"),
    Flag("--lora-modules", "lora_modules", metavar_override="NAME=PATH|JSON", many=True),
    Flag("--host", "api_host"),
    Flag("--port", "api_port"),
    Flag("--api-server-count", "api_server_count"),
    Flag("--enable-prompt-tokens-details", "enable_prompt_tokens_details"),
    Flag("--max-logprobs", "max_logprobs"),
    Flag("--stream-interval", "stream_interval"),
    Flag("--max-num-queued-reqs", "max_num_queued_reqs"),
    Flag("--max-num-queued-tokens", "max_num_queued_tokens"),
    Flag("--enable-server-load-tracking", "enable_server_load_tracking"),
    Flag("--enable-request-id-headers", "enable_request_id_headers"),
    Flag("--enable-force-include-usage", "enable_force_include_usage"),
    Flag("--return-tokens-as-token-ids", "return_tokens_as_token_ids"),
    Flag("--response-role", "response_role"),
    Flag("--sse-keep-alive-interval", "sse_keep_alive_interval"),
    Flag("--allowed-origins", "allowed_origins", metavar_override="JSON"),
    Flag("--allowed-methods", "allowed_methods", metavar_override="JSON"),
    Flag("--allowed-headers", "allowed_headers", metavar_override="JSON"),
    Flag("--allow-credentials", "allow_credentials"),
)
FLAG_OF_KEY: dict[str, Flag] = {flag.key: flag for flag in FLAGS}
assert len(FLAG_OF_KEY) == len(FLAGS), "two flags set the same key"
assert all(flag.key in KEYS for flag in FLAGS), "a flag names no scalar key"
assert all(flag.key in HELP for flag in FLAGS), "a flag's field has no description"
