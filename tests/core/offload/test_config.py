"""`OffloadConfig`: upstream defaults, when `from_args` attaches tiers, and its refusals."""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import EngineArgs
from engined.core.errors import InvalidArgsError
from engined.core.offload.config import OffloadConfig


def _args(**fields: Any) -> EngineArgs:
    return EngineArgs(block_size=64, **fields)


def test_defaults_are_upstream() -> None:
    config = OffloadConfig()
    assert config.num_g2_blocks == 100_000
    assert config.block_size_tokens == 64
    assert config.offload_batch_size == 32
    assert config.num_g3_blocks is None
    assert config.block_size_bytes is None
    assert config.block_bytes == 0
    assert (config.bandwidth_g1_to_g2_gbps, config.bandwidth_g2_to_g1_gbps) == (14.0, 14.0)
    assert (config.bandwidth_g2_to_g3_gbps, config.bandwidth_g3_to_g2_gbps) == (7.0, 7.0)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"num_g2_blocks": 10_000},
        {"kv_bytes_per_token": 131_072},
        {"num_g2_blocks": 0, "kv_bytes_per_token": 131_072},
        {"num_g2_blocks": 0, "kv_bytes_per_token": 131_072, "num_g3_blocks": 5},
    ],
)
def test_no_tiers_without_g2_and_bytes(fields: dict[str, Any]) -> None:
    assert OffloadConfig.from_args(_args(**fields)) is None


def test_from_args_derives_block_bytes_and_defaults() -> None:
    config = OffloadConfig.from_args(_args(num_g2_blocks=10_000, kv_bytes_per_token=131_072))
    assert config == OffloadConfig(
        num_g2_blocks=10_000, block_size_tokens=64, block_size_bytes=64 * 131_072
    )


def test_from_args_threads_every_knob() -> None:
    config = OffloadConfig.from_args(
        _args(
            num_g2_blocks=10_000,
            kv_bytes_per_token=2,
            offload_batch_size=16,
            num_g3_blocks=20_000,
            bandwidth_g1_to_g2_gbps=8.0,
            bandwidth_g2_to_g1_gbps=12.0,
            bandwidth_g2_to_g3_gbps=3.0,
            bandwidth_g3_to_g2_gbps=0.0,
        )
    )
    assert config == OffloadConfig(
        num_g2_blocks=10_000,
        block_size_tokens=64,
        offload_batch_size=16,
        num_g3_blocks=20_000,
        block_size_bytes=128,
        bandwidth_g1_to_g2_gbps=8.0,
        bandwidth_g2_to_g1_gbps=12.0,
        bandwidth_g2_to_g3_gbps=3.0,
        bandwidth_g3_to_g2_gbps=0.0,
    )


def test_zero_g3_and_batch_size_mean_unset() -> None:
    config = OffloadConfig.from_args(
        _args(num_g2_blocks=10_000, kv_bytes_per_token=1, num_g3_blocks=0, offload_batch_size=0)
    )
    assert config is not None
    assert config.num_g3_blocks is None
    assert config.offload_batch_size == 32


def test_from_normalized_json_args() -> None:
    args = EngineArgs.from_mapping(
        {"num_g2_blocks": 8, "num_g3_blocks": 4, "kv_bytes_per_token": 10, "block_size": 4}
    )
    config = OffloadConfig.from_args(args)
    assert config is not None
    assert (config.num_g2_blocks, config.num_g3_blocks, config.block_bytes) == (8, 4, 40)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"num_g3_blocks": 5, "kv_bytes_per_token": 1},
            "G3/G4 offload requires num_g2_blocks because mocker stages lower tiers through G2",
        ),
        (
            {"enable_g4_storage": True, "kv_bytes_per_token": 1},
            "G3/G4 offload requires num_g2_blocks because mocker stages lower tiers through G2",
        ),
        (
            {"num_g2_blocks": 10, "num_g3_blocks": 5},
            "G3/G4 offload requires kv_bytes_per_token so mocker can size lower-tier transfers",
        ),
        (
            {"num_g2_blocks": 10, "enable_g4_storage": True},
            "G3/G4 offload requires kv_bytes_per_token so mocker can size lower-tier transfers",
        ),
        (
            {"num_g2_blocks": 10, "kv_bytes_per_token": 1, "enable_g4_storage": True},
            "enable_g4_storage is not supported: engined models the G2 (host) and G3 (disk) "
            "tiers only",
        ),
    ],
)
def test_refusals(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgsError) as error:
        OffloadConfig.from_args(_args(**fields))
    assert str(error.value) == message


@pytest.mark.parametrize(
    "fields",
    [
        {"num_g2_blocks": 0},
        {"block_size_tokens": 0},
        {"offload_batch_size": 0},
        {"num_g3_blocks": 0},
        {"block_size_bytes": -1},
        {"bandwidth_g2_to_g3_gbps": float("nan")},
    ],
)
def test_constructor_rejects_impossible_shapes(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgsError):
        OffloadConfig(**fields)
