"""EngineArgs: defaults, materialisation, upstream messages and their order, config loading."""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any

import msgspec
import pytest

from engined.core.args import (
    EngineArgs,
    EngineType,
    PerfModelKind,
    PreemptionMode,
    SglangArgs,
    TrtllmArgs,
    WorkerType,
    _schema_error,
    rust_f64,
)
from engined.core.errors import InvalidArgsError
from engined.core.types import KvTransferTimingMode


def raises(message: str) -> Any:
    return pytest.raises(InvalidArgsError, match=re.escape(message))


# --- defaults and materialisation ------------------------------------------------------------


def test_defaults_match_upstream_builder() -> None:
    args = EngineArgs.from_mapping({})
    assert args == EngineArgs().normalized()
    assert args.engine_type is EngineType.VLLM
    assert (args.num_gpu_blocks, args.block_size) == (16384, 64)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 8192)
    assert args.enable_prefix_caching and args.enable_chunked_prefill
    assert (args.speedup_ratio, args.decode_speedup_ratio, args.dp_size) == (1.0, 1.0, 1)
    assert args.worker_type is WorkerType.AGGREGATED
    assert args.preemption_mode is PreemptionMode.LIFO
    assert args.kv_transfer_timing_mode is KvTransferTimingMode.FULL_PROMPT
    assert (args.aic_mtp_seed, args.handoff_session_timeout_ms) == (42, 300000)
    assert args.kv_transfer_bandwidth is None and args.max_model_len is None
    assert args.aic_nextn is None and args.aic_nextn_accept_rates is None
    assert args.nextn_accept_rates == []
    assert (args.seed, args.perf_model) == (0, PerfModelKind.POLYNOMIAL)
    assert not (args.is_prefill or args.is_decode or args.uses_trtllm_policy)


@pytest.mark.parametrize(
    ("config", "block_size"),
    [
        ({}, 64),
        ({"engine_type": "trtllm"}, 32),
        ({"engine_type": "sglang"}, 1),
        ({"engine_type": "sglang", "sglang": {"page_size": 16}}, 16),
        ({"engine_type": "sglang", "block_size": 8, "sglang": {"page_size": 8}}, 8),
        ({"block_size": 16}, 16),
        ({"engine_type": "trtllm", "block_size": 4}, 4),
    ],
)
def test_block_size_materialisation(config: dict[str, Any], block_size: int) -> None:
    assert EngineArgs.from_mapping(config).block_size == block_size


def test_zero_offload_knobs_become_none() -> None:
    args = EngineArgs(num_g2_blocks=0, num_g3_blocks=0, offload_batch_size=0).normalized()
    assert (args.num_g2_blocks, args.num_g3_blocks, args.offload_batch_size) == (None, None, None)
    assert not args.enable_g4_storage


def test_zero_g3_does_not_require_g2() -> None:
    assert EngineArgs(num_g3_blocks=0).normalized().num_g3_blocks is None


def test_offload_tiers_with_g2() -> None:
    args = EngineArgs(num_g2_blocks=10, num_g3_blocks=10, enable_g4_storage=True).normalized()
    assert (args.num_g2_blocks, args.num_g3_blocks, args.kv_bytes_per_token) == (10, 10, None)


def test_normalized_returns_new_instance_and_is_idempotent() -> None:
    raw = EngineArgs(aic_nextn=3, aic_nextn_accept_rates=" 1, 0.5 ", num_g2_blocks=0)
    once = raw.normalized()
    assert once is not raw
    assert (raw.block_size, raw.aic_nextn_accept_rates) == (0, " 1, 0.5 ")
    assert once.normalized() == once
    assert once.normalized().normalized() == once


def test_args_are_frozen() -> None:
    args = EngineArgs().normalized()
    with pytest.raises(AttributeError):
        args.block_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("worker_type", "is_prefill", "is_decode"),
    [("aggregated", False, False), ("prefill", True, False), ("decode", False, True)],
)
def test_worker_type_properties(worker_type: str, is_prefill: bool, is_decode: bool) -> None:
    args = EngineArgs.from_mapping({"worker_type": worker_type})
    assert (args.is_prefill, args.is_decode) == (is_prefill, is_decode)


def test_trtllm_uses_trtllm_policy() -> None:
    assert EngineArgs.from_mapping({"engine_type": "trtllm"}).uses_trtllm_policy
    assert not EngineArgs.from_mapping({"engine_type": "sglang"}).uses_trtllm_policy


@pytest.mark.parametrize(
    ("config", "enforced"),
    [
        ({}, None),
        ({"max_model_len": 100}, 100),
        ({"enable_chunked_prefill": False}, 8192),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, 64),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 100}, 64),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 40}, 40),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": None}, None),
        # vLLM's scheduled-token cap is the budget a sequence must fit, where lower.
        ({"enable_chunked_prefill": False, "max_num_scheduled_tokens": 48}, 48),
        ({"enable_chunked_prefill": False, "max_num_scheduled_tokens": 10**5}, 8192),
        ({"max_num_scheduled_tokens": 48}, None),
        ({"enable_chunked_prefill": False, "semantics": "mocker-1.3.0"}, None),
        ({"enable_chunked_prefill": False, "prefix_hit_rule": "mocker-1.3.0"}, None),
        # MTP runs vLLM's scheduler too.
        ({"enable_chunked_prefill": False, "aic_nextn": 1}, 8192),
        ({"enable_chunked_prefill": False, "engine_type": "trtllm"}, None),
    ],
)
def test_without_chunked_prefill_the_budget_limits_a_sequence(
    config: dict[str, Any], enforced: int | None
) -> None:
    assert EngineArgs.from_mapping(config).enforced_max_model_len == enforced


# --- MTP accept rates ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nextn", "rates", "normalised", "floats"),
    [
        (3, None, "0.85,0.3,0", [0.85, 0.3, 0.0]),
        (3, "   ", "0.85,0.3,0", [0.85, 0.3, 0.0]),
        (5, "", "0.85,0.3,0,0,0", [0.85, 0.3, 0.0, 0.0, 0.0]),
        (1, None, "0.85", [0.85]),
        (3, "1,0.5", "1,0.5,0", [1.0, 0.5, 0.0]),
        (2, "1,0.5,0.25", "1,0.5", [1.0, 0.5]),
        (2, " 1.0 , .5 ", "1,0.5", [1.0, 0.5]),
        (2, "1e-7,+0.", "0.0000001,0", [1e-7, 0.0]),
    ],
)
def test_accept_rate_normalisation(
    nextn: int, rates: str | None, normalised: str, floats: list[float]
) -> None:
    args = EngineArgs(aic_nextn=nextn, aic_nextn_accept_rates=rates).normalized()
    assert args.aic_nextn_accept_rates == normalised
    assert args.nextn_accept_rates == floats


def test_nextn_accept_rates_returns_a_copy() -> None:
    args = EngineArgs(aic_nextn=2).normalized()
    args.nextn_accept_rates.append(1.0)
    assert args.nextn_accept_rates == [0.85, 0.3]


@pytest.mark.parametrize(
    ("rates", "message"),
    [
        ("abc", 'invalid aic_nextn_accept_rates value "abc": invalid float literal'),
        ("1, abc", 'invalid aic_nextn_accept_rates value " abc": invalid float literal'),
        ("1,", 'invalid aic_nextn_accept_rates value "": cannot parse float from empty string'),
        ("1_0", 'invalid aic_nextn_accept_rates value "1_0": invalid float literal'),
        ('"x"', 'invalid aic_nextn_accept_rates value "\\"x\\"": invalid float literal'),
        ("1,\tq", 'invalid aic_nextn_accept_rates value "\\tq": invalid float literal'),
        ("nan", "aic_nextn_accept_rates[0] must be finite and in [0, 1], got NaN"),
        ("0.5,inf", "aic_nextn_accept_rates[1] must be finite and in [0, 1], got inf"),
        ("-0.1", "aic_nextn_accept_rates[0] must be finite and in [0, 1], got -0.1"),
        ("1.1", "aic_nextn_accept_rates[0] must be finite and in [0, 1], got 1.1"),
        ("0,0,2", "aic_nextn_accept_rates[2] must be finite and in [0, 1], got 2"),
    ],
)
def test_accept_rate_errors(rates: str, message: str) -> None:
    with raises(message):
        EngineArgs(aic_nextn=1, aic_nextn_accept_rates=rates).normalized()


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.0, "1"),
        (0.0, "0"),
        (-0.0, "-0"),
        (0.85, "0.85"),
        (2.5, "2.5"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e-7, "0.0000001"),
        (1e21, "1000000000000000000000"),
        (math.nan, "NaN"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
    ],
)
def test_rust_f64_display(value: float, text: str) -> None:
    assert rust_f64(value) == text


# --- range validation ------------------------------------------------------------------------

PREFIX = "Failed to validate MockEngineArgs: "


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be >= 1, got 0"),
        ({"block_size": -1}, "block_size must be >= 0, got -1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"speedup_ratio": -1.0}, "speedup_ratio must be >= 0, got -1"),
        ({"speedup_ratio": math.nan}, "speedup_ratio must be >= 0, got NaN"),
        ({"speedup_ratio": math.inf}, "speedup_ratio must be finite, got inf"),
        ({"decode_speedup_ratio": -0.5}, "decode_speedup_ratio must be >= 0, got -0.5"),
        ({"dp_size": 0}, "dp_size must be >= 1, got 0"),
        ({"startup_time": -1.5}, "startup_time must be >= 0, got -1.5"),
        ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
        ({"max_num_active_seqs": 0}, "max_num_active_seqs must be >= 1, got 0"),
        ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens must be >= 1, got 0"),
        ({"prefill_schedule_interval": 0}, "prefill_schedule_interval must be >= 1, got 0"),
        (
            {"long_prefill_token_threshold": -1},
            "long_prefill_token_threshold must be >= 0, got -1",
        ),
        ({"aic_nextn": 0}, "aic_nextn must be in [1, 5], got 0"),
        ({"aic_nextn": 6}, "aic_nextn must be in [1, 5], got 6"),
        ({"aic_mtp_seed": -1}, "aic_mtp_seed must be in [0, 18446744073709551615], got -1"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be >= 1, got 0"),
        ({"kv_transfer_bandwidth": -1.0}, "kv_transfer_bandwidth must be >= 0, got -1"),
        ({"handoff_session_timeout_ms": 0}, "handoff_session_timeout_ms must be >= 1, got 0"),
        ({"num_g2_blocks": -1}, "num_g2_blocks must be >= 1, got -1"),
        ({"num_g3_blocks": -2}, "num_g3_blocks must be >= 1, got -2"),
        ({"offload_batch_size": -3}, "offload_batch_size must be >= 1, got -3"),
        ({"bandwidth_g1_to_g2_gbps": -1.0}, "bandwidth_g1_to_g2_gbps must be >= 0, got -1"),
        ({"bandwidth_g4_to_g2_gbps": math.nan}, "bandwidth_g4_to_g2_gbps must be >= 0, got NaN"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in [0, 1], got 1.5"),
        ({"mem_fraction_static": -0.1}, "mem_fraction_static must be in [0, 1], got -0.1"),
        (
            {"free_gpu_memory_fraction": math.nan},
            "free_gpu_memory_fraction must be in [0, 1], got NaN",
        ),
        ({"bootstrap_port": 70000}, "bootstrap_port must be in [0, 65535], got 70000"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        (
            {"fixed_prefill_ms_per_token": -0.01},
            "fixed_prefill_ms_per_token must be >= 0, got -0.01",
        ),
        ({"fixed_pass_overhead_ms": -1.0}, "fixed_pass_overhead_ms must be >= 0, got -1"),
        (
            {"fixed_decode_ms_per_pass": math.inf},
            "fixed_decode_ms_per_pass must be finite, got inf",
        ),
        ({"sglang": SglangArgs(page_size=0)}, "sglang.page_size must be >= 1, got 0"),
        (
            {"sglang": SglangArgs(max_prefill_tokens=0)},
            "sglang.max_prefill_tokens must be >= 1, got 0",
        ),
        (
            {"sglang": SglangArgs(chunked_prefill_size=0)},
            "sglang.chunked_prefill_size must be >= 1, got 0",
        ),
        (
            {"sglang": SglangArgs(clip_max_new_tokens=0)},
            "sglang.clip_max_new_tokens must be >= 1, got 0",
        ),
        (
            {"sglang": SglangArgs(schedule_conservativeness=1.25)},
            "sglang.schedule_conservativeness must be in [0, 1], got 1.25",
        ),
    ],
)
def test_range_errors(fields: dict[str, Any], message: str) -> None:
    with raises(PREFIX + message):
        EngineArgs(**fields).normalized()


# --- schema checks, in upstream order --------------------------------------------------------

SCHEMA_CASES = [
    pytest.param(
        {"block_size": 1},
        "the vLLM/TRT-LLM scheduler requires block_size to be at least 2 "
        "for engine_type=Vllm, got block_size=1",
        id="vllm-block-size",
    ),
    pytest.param(
        {"engine_type": EngineType.TRTLLM, "block_size": 1},
        "the vLLM/TRT-LLM scheduler requires block_size to be at least 2 "
        "for engine_type=Trtllm, got block_size=1",
        id="trtllm-block-size",
    ),
    pytest.param(
        {"num_g3_blocks": 4},
        "num_g3_blocks requires num_g2_blocks because mocker stages G3 through G2",
        id="g3-needs-g2",
    ),
    pytest.param(
        {"engine_type": EngineType.TRTLLM, "max_model_len": 128},
        "max_model_len is supported only for engine_type=vllm, got engine_type=Trtllm",
        id="max-model-len-trtllm",
    ),
    pytest.param(
        {"engine_type": EngineType.SGLANG, "max_model_len": 128},
        "max_model_len is supported only for engine_type=vllm, got engine_type=Sglang",
        id="max-model-len-sglang",
    ),
    pytest.param(
        {"max_num_seqs": 4, "max_num_active_seqs": 5},
        "max_num_active_seqs (5) cannot be greater than max_num_seqs (4).",
        id="active-over-max-num-seqs",
    ),
    pytest.param({"watermark": 1.0}, "watermark must be in [0, 1), got 1", id="watermark-1"),
    pytest.param({"watermark": -0.5}, "watermark must be in [0, 1), got -0.5", id="watermark-neg"),
    pytest.param(
        {"max_model_len": 64, "long_prefill_token_threshold": 65},
        "long_prefill_token_threshold (65) cannot be greater than the max_model_len (64).",
        id="long-prefill-over-max-model-len",
    ),
    pytest.param(
        {"enable_g4_storage": True},
        "enable_g4_storage requires num_g2_blocks because mocker stages G4 through G2",
        id="g4-needs-g2",
    ),
    pytest.param(
        {"aic_nextn": 1, "decode_speedup_ratio": 2.0},
        "aic_nextn requires decode_speedup_ratio=1.0 because MTP output acceleration is "
        "modeled by burst sampling, got 2",
        id="mtp-decode-speedup-int",
    ),
    pytest.param(
        {"aic_nextn": 1, "decode_speedup_ratio": 0.5},
        "aic_nextn requires decode_speedup_ratio=1.0 because MTP output acceleration is "
        "modeled by burst sampling, got 0.5",
        id="mtp-decode-speedup-frac",
    ),
    pytest.param(
        {"aic_nextn_accept_rates": "0.5"},
        "aic_nextn_accept_rates requires aic_nextn",
        id="rates-need-nextn",
    ),
    pytest.param(
        {
            "engine_type": EngineType.TRTLLM,
            "trtllm": TrtllmArgs(capacity_scheduler_policy="max_utilization"),
        },
        "engine_type=trtllm v1 supports only "
        "capacity_scheduler_policy='guaranteed_no_evict', got 'max_utilization'",
        id="trtllm-policy",
    ),
    pytest.param(
        {"engine_type": EngineType.SGLANG, "block_size": 8, "sglang": SglangArgs(page_size=4)},
        "engine_type=sglang requires block_size and sglang.page_size to match when both "
        "are set, got block_size=8 and sglang.page_size=4",
        id="sglang-page-size",
    ),
    pytest.param(
        {
            "engine_type": EngineType.SGLANG,
            "block_size": 4,
            "sglang": SglangArgs(page_size=4, chunked_prefill_size=6),
        },
        "engine_type=sglang requires sglang.chunked_prefill_size to be divisible by "
        "block_size, got chunked_prefill_size=6 and block_size=4",
        id="sglang-chunked-prefill",
    ),
]


@pytest.mark.parametrize(("fields", "message"), SCHEMA_CASES)
def test_schema_errors(fields: dict[str, Any], message: str) -> None:
    with raises(message):
        EngineArgs(**fields).normalized()


def test_block_size_zero_message() -> None:
    # Materialisation never leaves block_size at 0 (an sglang page_size of 0 fails its range
    # first), so upstream's first schema check is only reachable on raw args.
    assert _schema_error(EngineArgs(block_size=0)) == "block_size must be greater than 0"


@pytest.mark.parametrize(
    "fields",
    [
        {"engine_type": EngineType.SGLANG, "block_size": 1},
        {"engine_type": EngineType.TRTLLM, "trtllm": TrtllmArgs()},
        {"trtllm": TrtllmArgs(capacity_scheduler_policy="guaranteed_no_evict")},
        {"engine_type": EngineType.SGLANG, "sglang": SglangArgs(chunked_prefill_size=7)},
        {"max_model_len": 4096},
        {"aic_nextn": 2, "decode_speedup_ratio": 1.0},
    ],
)
def test_schema_accepts(fields: dict[str, Any]) -> None:
    EngineArgs(**fields).normalized()


def test_trtllm_policy_is_checked_for_any_engine() -> None:
    with raises("capacity_scheduler_policy='guaranteed_no_evict', got 'static_batch'"):
        EngineArgs(trtllm=TrtllmArgs(capacity_scheduler_policy="static_batch")).normalized()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_gpu_blocks": 0, "block_size": 1}, PREFIX + "num_gpu_blocks must be >= 1, got 0"),
        ({"block_size": 1, "num_g3_blocks": 4}, "requires block_size to be at least 2"),
        (
            {"num_g3_blocks": 4, "engine_type": EngineType.TRTLLM, "max_model_len": 8},
            "num_g3_blocks requires num_g2_blocks",
        ),
        (
            {"engine_type": EngineType.TRTLLM, "max_model_len": 8, "enable_g4_storage": True},
            "max_model_len is supported only for engine_type=vllm",
        ),
        (
            {"enable_g4_storage": True, "aic_nextn": 1, "decode_speedup_ratio": 2.0},
            "enable_g4_storage requires num_g2_blocks",
        ),
        (
            {"aic_nextn": 1, "decode_speedup_ratio": 2.0, "aic_nextn_accept_rates": "x"},
            "aic_nextn requires decode_speedup_ratio=1.0",
        ),
        (
            {"aic_nextn_accept_rates": "x", "trtllm": TrtllmArgs(capacity_scheduler_policy="x")},
            "aic_nextn_accept_rates requires aic_nextn",
        ),
        (
            {
                "engine_type": EngineType.SGLANG,
                "block_size": 8,
                "trtllm": TrtllmArgs(capacity_scheduler_policy="x"),
                "sglang": SglangArgs(page_size=4),
            },
            "engine_type=trtllm v1 supports only",
        ),
        (
            {
                "engine_type": EngineType.SGLANG,
                "block_size": 8,
                "sglang": SglangArgs(page_size=4, chunked_prefill_size=6),
            },
            "block_size and sglang.page_size to match",
        ),
        ({"aic_nextn": 1, "aic_nextn_accept_rates": "x", "aic_mtp_seed": -1}, "aic_mtp_seed"),
    ],
)
def test_earlier_rule_wins(fields: dict[str, Any], message: str) -> None:
    with raises(message):
        EngineArgs(**fields).normalized()


# --- loading from a mapping ------------------------------------------------------------------


def test_unknown_key_is_named() -> None:
    with raises("Object contains unknown field `swap_space`"):
        EngineArgs.from_mapping({"swap_space": 4})


def test_unknown_nested_key_is_named() -> None:
    with raises("Object contains unknown field `page_sizes` - at `$.sglang`"):
        EngineArgs.from_mapping({"engine_type": "sglang", "sglang": {"page_sizes": 4}})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"block_size": "16"}, "Expected `int`, got `str` - at `$.block_size`"),
        ({"gpu_memory_utilization": "bad"}, "- at `$.gpu_memory_utilization`"),
        ({"enable_prefix_caching": 1}, "Expected `bool`, got `int` - at `$.enable_prefix_caching`"),
        ({"num_gpu_blocks": 1.5}, "Expected `int`, got `float` - at `$.num_gpu_blocks`"),
        ({"sglang": {"page_size": "4"}}, "- at `$.sglang.page_size`"),
        ({"engine_type": 3}, "- at `$.engine_type`"),
        ({"is_prefill": "yes"}, "Expected `bool | null`, got `str` - at `$.is_prefill`"),
    ],
)
def test_wrong_type_is_named(config: dict[str, Any], message: str) -> None:
    with raises(message):
        EngineArgs.from_mapping(config)


def test_int_accepted_for_float_field() -> None:
    assert EngineArgs.from_mapping({"speedup_ratio": 2}).speedup_ratio == 2.0


@pytest.mark.parametrize(
    "field",
    [
        "engine_type",
        "block_size",
        "enable_prefix_caching",
        "speedup_ratio",
        "dp_size",
        "worker_type",
        "aic_mtp_seed",
        "enable_g4_storage",
        "preemption_mode",
        "kv_transfer_timing_mode",
        "seed",
        "perf_model",
    ],
)
def test_null_for_non_nullable_field(field: str) -> None:
    with raises(f"{field} must not be null"):
        EngineArgs.from_mapping({field: None})


def test_null_num_gpu_blocks_keeps_default() -> None:
    # Upstream deserialises num_gpu_blocks as nullable and keeps the builder default.
    assert EngineArgs.from_mapping({"num_gpu_blocks": None}).num_gpu_blocks == 16384


def test_null_for_nullable_fields() -> None:
    args = EngineArgs.from_mapping(
        {"max_num_seqs": None, "max_num_batched_tokens": None, "startup_time": None}
    )
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.startup_time) == (None,) * 3


@pytest.mark.parametrize(
    ("config", "worker_type"),
    [
        ({"is_prefill": True}, WorkerType.PREFILL),
        ({"is_decode": True}, WorkerType.DECODE),
        ({"is_prefill": False, "is_decode": False}, WorkerType.AGGREGATED),
        ({"is_prefill": True, "is_decode": False}, WorkerType.PREFILL),
        ({"worker_type": "decode", "is_prefill": True}, WorkerType.DECODE),
        (
            {"worker_type": "aggregated", "is_prefill": True, "is_decode": True},
            WorkerType.AGGREGATED,
        ),
    ],
)
def test_legacy_worker_flags(config: dict[str, Any], worker_type: WorkerType) -> None:
    assert EngineArgs.from_mapping(config).worker_type is worker_type


def test_legacy_worker_flags_both_true() -> None:
    with raises("Invalid worker configuration: is_prefill and is_decode cannot both be true."):
        EngineArgs.from_mapping({"is_prefill": True, "is_decode": True})


def test_legacy_worker_flag_null() -> None:
    with raises("is_decode must not be null"):
        EngineArgs.from_mapping({"is_decode": None})


def test_has_perf_model_is_ignored() -> None:
    assert EngineArgs.from_mapping({"has_perf_model": True}) == EngineArgs().normalized()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"engine_type": "vllm2"},
            "Invalid engine_type 'vllm2'. Must be 'vllm', 'sglang', or 'trtllm'.",
        ),
        (
            {"worker_type": "both"},
            "Invalid worker_type 'both'. Must be 'aggregated', 'prefill', or 'decode'.",
        ),
        (
            {"preemption_mode": "Random"},
            "Invalid preemption_mode: 'Random'. Must be 'lifo' or 'fifo'.",
        ),
        (
            {"kv_transfer_timing_mode": "lazy"},
            "Invalid kv_transfer_timing_mode 'lazy'. "
            "Must be 'full_prompt' or 'destination_missing'.",
        ),
    ],
)
def test_enum_parse_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgsError) as info:
        EngineArgs.from_mapping(config)
    assert str(info.value) == message


def test_enum_values_are_case_insensitive() -> None:
    args = EngineArgs.from_mapping(
        {
            "engine_type": "TrtLLM",
            "worker_type": "Prefill",
            "preemption_mode": "FIFO",
            "kv_transfer_timing_mode": "Destination_Missing",
        }
    )
    assert args.engine_type is EngineType.TRTLLM
    assert args.worker_type is WorkerType.PREFILL
    assert args.preemption_mode is PreemptionMode.FIFO
    assert args.kv_transfer_timing_mode is KvTransferTimingMode.DESTINATION_MISSING


def test_from_mapping_normalises() -> None:
    with raises("num_g3_blocks requires num_g2_blocks"):
        EngineArgs.from_mapping({"num_g3_blocks": 3})
    args = EngineArgs.from_mapping({"aic_nextn": 3, "offload_batch_size": 0})
    assert (args.aic_nextn_accept_rates, args.offload_batch_size) == ("0.85,0.3,0", None)


def test_from_toml() -> None:
    text = """
    engine_type = "sglang"
    num_gpu_blocks = 512
    max_num_seqs = 8
    speedup_ratio = 0
    worker_type = "decode"
    aic_nextn = 2
    aic_nextn_accept_rates = "0.9"
    perf_model = "fixed"
    fixed_decode_ms_per_pass = 5
    reasoning = { start_thinking_token_id = 1, end_thinking_token_id = 2, thinking_ratio = 0.5 }

    [sglang]
    page_size = 16
    chunked_prefill_size = 64
    """
    args = EngineArgs.from_mapping(tomllib.loads(text))
    assert args.engine_type is EngineType.SGLANG
    assert (args.num_gpu_blocks, args.block_size, args.max_num_seqs) == (512, 16, 8)
    assert args.speedup_ratio == 0.0 and args.is_decode
    assert args.aic_nextn_accept_rates == "0.9,0"
    assert args.nextn_accept_rates == [0.9, 0.0]
    assert (args.perf_model, args.fixed_decode_ms_per_pass) == (PerfModelKind.FIXED, 5.0)
    assert args.sglang == SglangArgs(page_size=16, chunked_prefill_size=64)
    assert args.reasoning == {
        "start_thinking_token_id": 1,
        "end_thinking_token_id": 2,
        "thinking_ratio": 0.5,
    }


def test_from_toml_reports_bad_table() -> None:
    with raises("Object contains unknown field `capacity_policy` - at `$.trtllm`"):
        EngineArgs.from_mapping(tomllib.loads('[trtllm]\ncapacity_policy = "x"\n'))


def test_dynamo_mocker_json_loads() -> None:
    """A config written for Dynamo's mocker (including keys the core ignores) loads unchanged."""
    config = msgspec.json.decode(
        b"""{
        "engine_type": "vllm", "num_gpu_blocks": 1024, "block_size": 16,
        "max_num_seqs": null, "max_num_batched_tokens": 2048,
        "enable_prefix_caching": true, "enable_chunked_prefill": false,
        "speedup_ratio": 10.0, "decode_speedup_ratio": 1.0, "dp_size": 2,
        "startup_time": null, "worker_type": "prefill", "planner_profile_data": null,
        "aic_backend": "vllm", "aic_system": "h200_sxm", "aic_backend_version": null,
        "aic_tp_size": 2, "aic_model_path": null, "aic_moe_tp_size": null,
        "aic_moe_ep_size": null, "aic_attention_dp_size": null, "aic_gemm_dtype": null,
        "aic_moe_dtype": null, "aic_fmha_dtype": null, "aic_kv_cache_dtype": null,
        "aic_comm_dtype": null, "gpu_memory_utilization": 0.9, "mem_fraction_static": null,
        "free_gpu_memory_fraction": null, "enable_local_indexer": false,
        "bootstrap_port": 9001, "handoff_session_timeout_ms": 1000,
        "kv_bytes_per_token": 131072, "kv_transfer_bandwidth": 64.0,
        "kv_transfer_timing_mode": "destination_missing", "num_g2_blocks": 0,
        "num_g3_blocks": null, "enable_g4_storage": false, "offload_batch_size": null,
        "bandwidth_g1_to_g2_gbps": null, "bandwidth_g2_to_g1_gbps": null,
        "bandwidth_g2_to_g3_gbps": null, "bandwidth_g3_to_g2_gbps": null,
        "bandwidth_g2_to_g4_gbps": null, "bandwidth_g4_to_g2_gbps": null,
        "reasoning": null, "response_replay_trace_path": null,
        "zmq_kv_events_port": 5557, "zmq_replay_port": null, "preemption_mode": "lifo",
        "router_queue_policy": null, "sglang": null, "trtllm": null, "has_perf_model": false
        }"""
    )
    args = EngineArgs.from_mapping(config)
    assert (args.block_size, args.max_num_seqs, args.dp_size) == (16, None, 2)
    assert args.is_prefill and not args.enable_chunked_prefill
    assert args.kv_transfer_timing_mode is KvTransferTimingMode.DESTINATION_MISSING
    assert (args.kv_bytes_per_token, args.kv_transfer_bandwidth) == (131072, 64.0)
    assert args.num_g2_blocks is None
