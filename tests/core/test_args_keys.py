"""Every refusal of engine arguments names its field in `InvalidArgsError.key`.

The daemon reports a bad engine setting under `exc.key` (`engine.block_size: ...`) and never
reads the key back out of upstream's message, so each raise site must set it. One row per
rule: the arguments that break it, and the key it must carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from engined.config import ConfigError, load_config
from engined.core.args import EngineArgs, SglangArgs, TrtllmArgs
from engined.core.errors import InvalidArgsError
from engined.core.offload.config import OffloadConfig

MTP = {"aic_nextn": 1}
SGLANG = {"engine_type": "sglang"}

# (raw mapping given to `from_mapping`, expected key)
MAPPING_CASES: list[Any] = [
    pytest.param({"is_prefill": 1}, "is_prefill", id="legacy-flag-type"),
    pytest.param({"is_decode": None}, "is_decode", id="legacy-flag-null"),
    pytest.param({"is_prefill": True, "is_decode": True}, "is_prefill", id="legacy-both"),
    pytest.param({"block_size": None}, "block_size", id="null"),
    pytest.param({"engine_type": "tpu"}, "engine_type", id="enum-engine"),
    pytest.param({"worker_type": "x"}, "worker_type", id="enum-worker"),
    pytest.param({"preemption_mode": "x"}, "preemption_mode", id="enum-preemption"),
    pytest.param({"kv_transfer_timing_mode": "x"}, "kv_transfer_timing_mode", id="enum-timing"),
    pytest.param({"prefix_hit_rule": "x"}, "prefix_hit_rule", id="enum-prefix-hit"),
    pytest.param({"dp_size": 2, "block_size": "x"}, "block_size", id="type"),
    pytest.param({"sglang": {"page_size": "x"}}, "sglang.page_size", id="type-sub-field"),
    pytest.param({"sglang": {"page_sise": 4}}, "sglang.page_sise", id="unknown-sub-field"),
    pytest.param({"blok_size": 4}, "blok_size", id="unknown"),
    pytest.param({"num_gpu_blocks": 0}, "num_gpu_blocks", id="range"),
    pytest.param({"speedup_ratio": float("inf")}, "speedup_ratio", id="range-finite"),
    pytest.param({"gpu_memory_utilization": 2.0}, "gpu_memory_utilization", id="range-bounds"),
    pytest.param({"sglang": {"page_size": 0}}, "sglang.page_size", id="range-sub-field"),
    pytest.param({"block_size": 1}, "block_size", id="block-size-at-least-2"),
    pytest.param({"num_g3_blocks": 4}, "num_g3_blocks", id="g3-needs-g2"),
    pytest.param({"engine_type": "trtllm", "max_model_len": 8}, "max_model_len", id="vllm-only"),
    pytest.param({"enable_g4_storage": True}, "enable_g4_storage", id="g4-needs-g2"),
    pytest.param({**MTP, "decode_speedup_ratio": 2.0}, "aic_nextn", id="mtp-speedup"),
    pytest.param({"aic_nextn_accept_rates": "0.5"}, "aic_nextn_accept_rates", id="rates-alone"),
    pytest.param(
        {"trtllm": {"capacity_scheduler_policy": "static_batch"}},
        "trtllm.capacity_scheduler_policy",
        id="trtllm-policy",
    ),
    pytest.param(
        {**SGLANG, "block_size": 8, "sglang": {"page_size": 4}}, "block_size", id="sglang-page"
    ),
    pytest.param(
        {**SGLANG, "block_size": 4, "sglang": {"chunked_prefill_size": 6}},
        "sglang.chunked_prefill_size",
        id="sglang-chunk",
    ),
    pytest.param({"vocab_size": 0}, "vocab_size", id="vocab-size"),
    pytest.param({"excluded_token_ids": [-1]}, "excluded_token_ids", id="excluded-negative"),
    pytest.param(
        {"vocab_size": 4, "excluded_token_ids": [4]}, "excluded_token_ids", id="excluded-beyond"
    ),
    pytest.param({"excluded_token_ids": [2**32]}, "excluded_token_ids", id="excluded-u32"),
    pytest.param(
        {"vocab_size": 2, "excluded_token_ids": [0, 1]}, "excluded_token_ids", id="excluded-all"
    ),
    pytest.param({**MTP, "aic_nextn_accept_rates": "x"}, "aic_nextn_accept_rates", id="rate-text"),
    pytest.param({**MTP, "aic_nextn_accept_rates": "2"}, "aic_nextn_accept_rates", id="rate-range"),
]


@pytest.mark.parametrize(("raw", "key"), MAPPING_CASES)
def test_from_mapping_errors_carry_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidArgsError) as info:
        EngineArgs.from_mapping(raw)
    assert info.value.key == key


def test_key_leaves_the_message_alone() -> None:
    error = InvalidArgsError("block_size must be greater than 0", key="block_size")
    assert (str(error), error.args) == ("block_size must be greater than 0", (error.args[0],))
    assert InvalidArgsError("no field").key is None


def test_accept_rates_key_on_direct_construction() -> None:
    # Reached only by a raw instance: ranges refuse such an aic_nextn first.
    with pytest.raises(InvalidArgsError) as info:
        _ = EngineArgs(aic_nextn=6).nextn_accept_rates
    assert info.value.key == "aic_nextn"


# (OffloadConfig fields, expected key): the EngineArgs field `from_args` fills each from.
OFFLOAD_FIELD_CASES: list[Any] = [
    pytest.param({"num_g2_blocks": 0}, "num_g2_blocks", id="g2"),
    pytest.param({"block_size_tokens": 0}, "block_size", id="block-size"),
    pytest.param({"offload_batch_size": 0}, "offload_batch_size", id="batch"),
    pytest.param({"num_g3_blocks": 0}, "num_g3_blocks", id="g3"),
    pytest.param({"block_size_bytes": -1}, "kv_bytes_per_token", id="bytes"),
    pytest.param(
        {"bandwidth_g3_to_g2_gbps": float("nan")}, "bandwidth_g3_to_g2_gbps", id="bandwidth"
    ),
]


@pytest.mark.parametrize(("fields", "key"), OFFLOAD_FIELD_CASES)
def test_offload_field_errors_carry_the_key(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidArgsError) as info:
        OffloadConfig(**fields)
    assert info.value.key == key


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        pytest.param({"num_g3_blocks": 4}, "num_g2_blocks", id="g3-needs-g2"),
        pytest.param({"num_g2_blocks": 8, "num_g3_blocks": 4}, "kv_bytes_per_token", id="bytes"),
        pytest.param(
            {"num_g2_blocks": 8, "kv_bytes_per_token": 2, "enable_g4_storage": True},
            "enable_g4_storage",
            id="g4",
        ),
    ],
)
def test_offload_from_args_errors_carry_the_key(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidArgsError) as info:
        OffloadConfig.from_args(EngineArgs(block_size=16, **fields))
    assert info.value.key == key


def test_every_key_is_a_field_path() -> None:
    """A key the daemon prints is a key a user can set (or a legacy one `from_mapping` takes)."""
    fields = {f.name: f.type for f in msgspec.structs.fields(EngineArgs)}
    tables: dict[str, type[msgspec.Struct]] = {"trtllm": TrtllmArgs, "sglang": SglangArgs}
    keys = [p.values[1] for p in MAPPING_CASES if "unknown" not in str(p.id)]
    keys += [p.values[1] for p in OFFLOAD_FIELD_CASES]
    for key in keys:
        table, _, sub = key.partition(".")
        if sub:
            assert sub in {f.name for f in msgspec.structs.fields(tables[table])}, key
        else:
            assert key in fields or key in {"is_prefill", "is_decode"}, key


@pytest.mark.parametrize(
    ("engine_table", "key"),
    [
        ('trtllm = { capacity_scheduler_policy = "x" }', "engine.trtllm.capacity_scheduler_policy"),
        ("num_g3_blocks = 4", "engine.num_g3_blocks"),
        ("num_g2_blocks = 8\nnum_g3_blocks = 4", "engine.kv_bytes_per_token"),
        ('aic_nextn = 1\naic_nextn_accept_rates = "x"', "engine.aic_nextn_accept_rates"),
        ("is_prefill = true\nis_decode = true", "engine.is_prefill"),
    ],
)
def test_config_error_uses_the_core_key(engine_table: str, key: str, tmp_path: Path) -> None:
    path = tmp_path / "engined.toml"
    path.write_text(f"[engine]\n{engine_table}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config_path=path, env={}, flags={})
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
