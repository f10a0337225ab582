"""Daemon configuration: layering, validation messages, endpoints, printing, flag coverage."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engined.config import (
    ENV_PREFIX,
    FLAGS,
    ConfigError,
    DaemonConfig,
    dump_config,
    endpoint_for_rank,
    env_name,
    load_config,
)
from engined.config.lora_modules import LoraModule, parse_lora_modules
from engined.core.args import EngineArgs, EngineType, PrefixHitRule, SglangArgs, WorkerType
from engined.core.vllm_hashing import HashAlgo


def load(
    toml: str | None = None,
    *,
    env: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
    tmp_path: Path | None = None,
) -> DaemonConfig:
    path = None
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "engined.toml"
        path.write_text(toml)
    return load_config(config_path=path, env=env or {}, flags=flags or {})


def raises(message: str) -> Any:
    return pytest.raises(ConfigError, match=re.escape(message))


# --- defaults ---------------------------------------------------------------------------------


def test_defaults() -> None:
    config = load()
    assert config == DaemonConfig()
    assert config.engine == EngineArgs.from_mapping({})
    assert config.engine.block_size == 64
    assert (config.model_name, config.control_endpoint) == ("engined", "tcp://127.0.0.1:5555")
    assert (config.kv_events_endpoint, config.kv_events_connect) == ("tcp://127.0.0.1:5557", False)
    assert (config.kv_replay_endpoint, config.kv_replay_buffer) == (None, 10000)
    assert (config.kv_events_topic, config.kv_events_format) == ("", "vllm")
    assert (config.fpm_endpoint, config.worker_id) == ("tcp://127.0.0.1:20380", "")
    assert (config.max_queued_requests, config.drain_timeout) == (4096, 30.0)
    assert (config.log_format, config.log_level, config.http_port) == ("auto", "info", None)


def test_unrelated_environment_is_ignored() -> None:
    assert load(env={"PATH": "/bin", "ENGINED": "x", "engined_block_size": "8"}) == DaemonConfig()


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("4", 4), ("-1", -1)])
def test_rank_processes(text: str, value: int) -> None:
    assert load(env={"ENGINED_RANK_PROCESSES": text}).rank_processes == value
    assert load(flags={"rank_processes": value}).rank_processes == value


def test_rank_processes_below_auto_is_refused() -> None:
    with raises("rank_processes") as info:
        load(flags={"rank_processes": -2})
    assert info.value.key == "rank_processes"


def test_realtime_priority() -> None:
    assert load().realtime_priority == 0
    assert load(env={"ENGINED_REALTIME_PRIORITY": "1"}).realtime_priority == 1
    assert load(flags={"realtime_priority": 99}).realtime_priority == 99


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "realtime_priority: Expected `int` >= 0, got -1"),
        (100, "realtime_priority: Expected `int` <= 99, got 100"),
        ("x", "realtime_priority: expected an integer, got 'x'"),
        (1.5, "realtime_priority: Expected `int`, got `float`"),
    ],
)
def test_realtime_priority_refusals(value: object, message: str) -> None:
    with raises(message) as info:
        load(flags={"realtime_priority": value})
    assert info.value.key == "realtime_priority"


def test_realtime_priority_needs_a_paced_daemon() -> None:
    """An unpaced rank never sleeps: at real-time priority it would hold its core."""
    with raises(
        "realtime_priority: needs engine.speedup_ratio > 0: an unpaced daemon never sleeps"
    ) as info:
        load(env={"ENGINED_REALTIME_PRIORITY": "1", "ENGINED_SPEEDUP_RATIO": "0"})
    assert info.value.key == "realtime_priority"
    assert load(flags={"realtime_priority": 1, "engine.speedup_ratio": 0.5}).realtime_priority == 1


def test_the_build_and_test_variables_are_not_settings() -> None:
    """`ENGINED_MYPYC=1`, `ENGINED_PURE=1` (the build, and the pure core at run time) and
    `ENGINED_EXPECT_COMPILED` (the test suite) may stay exported in a shell that then starts
    a daemon."""
    env = {"ENGINED_MYPYC": "1", "ENGINED_PURE": "1", "ENGINED_EXPECT_COMPILED": "0"}
    assert load(env=env) == DaemonConfig()


# --- layering ---------------------------------------------------------------------------------

TOML = """
drain_timeout = 5
log_level = "debug"
kv_replay_endpoint = "ipc:///tmp/replay"

[engine]
block_size = 16
enable_prefix_caching = false
num_gpu_blocks = 100
"""


def test_toml_sets_daemon_and_engine_keys(tmp_path: Path) -> None:
    config = load(TOML, tmp_path=tmp_path)
    assert (config.drain_timeout, config.log_level) == (5.0, "debug")
    assert config.kv_replay_endpoint == "ipc:///tmp/replay"
    assert (config.engine.block_size, config.engine.num_gpu_blocks) == (16, 100)
    assert config.engine.enable_prefix_caching is False


def test_env_overrides_toml(tmp_path: Path) -> None:
    env = {
        "ENGINED_BLOCK_SIZE": "32",
        "ENGINED_ENABLE_PREFIX_CACHING": "TRUE",
        "ENGINED_DRAIN_TIMEOUT": "7.5",
        "ENGINED_KV_REPLAY_ENDPOINT": "",
    }
    config = load(TOML, env=env, tmp_path=tmp_path)
    assert (config.engine.block_size, config.engine.enable_prefix_caching) == (32, True)
    assert (config.drain_timeout, config.kv_replay_endpoint) == (7.5, None)
    assert (config.log_level, config.engine.num_gpu_blocks) == ("debug", 100)


def test_flags_override_env_and_toml(tmp_path: Path) -> None:
    env = {"ENGINED_BLOCK_SIZE": "32", "ENGINED_DRAIN_TIMEOUT": "7.5"}
    flags = {"engine.block_size": "8", "drain_timeout": 1.0, "engine.enable_prefix_caching": True}
    config = load(TOML, env=env, flags=flags, tmp_path=tmp_path)
    assert (config.engine.block_size, config.drain_timeout) == (8, 1.0)
    assert config.engine.enable_prefix_caching is True
    assert (config.log_level, config.engine.num_gpu_blocks) == ("debug", 100)


def test_flag_text_is_parsed_like_env() -> None:
    flags = {
        "engine.dp_size": "2",
        "engine.speedup_ratio": "0",
        "engine.enable_chunked_prefill": "no",
        "fpm_endpoint": "",
        "engine.max_num_seqs": "",
        "worker_id": "w-1",
    }
    config = load(flags=flags)
    assert (config.engine.dp_size, config.engine.speedup_ratio) == (2, 0.0)
    assert config.engine.enable_chunked_prefill is False
    assert (config.fpm_endpoint, config.engine.max_num_seqs, config.worker_id) == (
        None,
        None,
        "w-1",
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("Yes", True), ("1", True), (" no ", False), ("FALSE", False), ("0", False)],
)
def test_env_booleans(text: str, value: bool) -> None:
    assert load(env={"ENGINED_KV_EVENTS_CONNECT": text}).kv_events_connect is value


def test_env_empty_string_is_none_only_for_optional_keys() -> None:
    config = load(env={"ENGINED_FPM_ENDPOINT": "", "ENGINED_KV_EVENTS_TOPIC": ""})
    assert (config.fpm_endpoint, config.kv_events_topic) == (None, "")
    with raises("engine.block_size: expected an integer, got '' (from ENGINED_BLOCK_SIZE)"):
        load(env={"ENGINED_BLOCK_SIZE": ""})


def test_toml_empty_string_is_none_for_optional_keys(tmp_path: Path) -> None:
    config = load('fpm_endpoint = ""\n[engine]\nmax_num_seqs = ""\n', tmp_path=tmp_path)
    assert (config.fpm_endpoint, config.engine.max_num_seqs) == (None, None)


def test_empty_kv_events_endpoint_turns_kv_events_off_in_every_layer(tmp_path: Path) -> None:
    assert load('kv_events_endpoint = ""\n', tmp_path=tmp_path).kv_events_endpoint is None
    assert load(env={"ENGINED_KV_EVENTS_ENDPOINT": ""}).kv_events_endpoint is None
    assert load(flags={"kv_events_endpoint": ""}).kv_events_endpoint is None


def test_kv_replay_without_kv_events_is_refused_naming_both_keys(tmp_path: Path) -> None:
    message = (
        'kv_replay_endpoint: replays KV events, but kv_events_endpoint = "" publishes none; '
        "unset one of them"
    )
    with raises(f"{message} (from {tmp_path / 'engined.toml'})"):
        load(
            'kv_events_endpoint = ""\nkv_replay_endpoint = "tcp://127.0.0.1:7000"\n',
            tmp_path=tmp_path,
        )
    with raises(f"{message} (from ENGINED_KV_REPLAY_ENDPOINT)"):
        load(
            env={
                "ENGINED_KV_EVENTS_ENDPOINT": "",
                "ENGINED_KV_REPLAY_ENDPOINT": "ipc:///tmp/replay",
            }
        )


def test_choices_ignore_case() -> None:
    config = load(env={"ENGINED_LOG_LEVEL": "WARNING", "ENGINED_ENGINE_TYPE": "TRTLLM"})
    assert (config.log_level, config.engine.engine_type) == ("warning", EngineType.TRTLLM)


def test_engine_table_takes_mocker_keys(tmp_path: Path) -> None:
    toml = '[engine]\nis_prefill = true\n[engine.sglang]\nschedule_policy = "lpm"\n'
    config = load(toml, tmp_path=tmp_path)
    assert config.engine.worker_type is WorkerType.PREFILL
    assert config.engine.sglang == SglangArgs(schedule_policy="lpm")


# --- refusals ---------------------------------------------------------------------------------


def test_unknown_toml_key(tmp_path: Path) -> None:
    with raises("drain_timout: unknown key in ") as info:
        load("drain_timout = 1\n", tmp_path=tmp_path)
    assert info.value.key == "drain_timout"
    assert str(info.value).endswith("(did you mean drain_timeout?)")


def test_unknown_engine_key(tmp_path: Path) -> None:
    with raises("engine.blok_size: unknown key") as info:
        load("[engine]\nblok_size = 16\n", tmp_path=tmp_path)
    assert info.value.key == "engine.blok_size"
    assert str(info.value).endswith("(did you mean block_size?)")


def test_engine_key_at_top_level(tmp_path: Path) -> None:
    with raises("block_size: unknown top-level key") as info:
        load("block_size = 16\n", tmp_path=tmp_path)
    assert info.value.key == "block_size"
    assert "engine keys belong in the [engine] table" in str(info.value)


def test_unknown_key_in_engine_sub_table(tmp_path: Path) -> None:
    with raises("engine.sglang.page_sise: Object contains unknown field `page_sise`") as info:
        load("[engine.sglang]\npage_sise = 16\n", tmp_path=tmp_path)
    assert info.value.key == "engine.sglang.page_sise"


def test_unknown_env_var() -> None:
    with raises("ENGINED_BLOK_SIZE: unknown environment variable") as info:
        load(env={"ENGINED_BLOK_SIZE": "16"})
    assert info.value.key is None
    assert str(info.value).endswith("(did you mean ENGINED_BLOCK_SIZE?)")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("ENGINED_BLOCK_SIZE", "16.5", "engine.block_size: expected an integer, got '16.5'"),
        ("ENGINED_DRAIN_TIMEOUT", "soon", "drain_timeout: expected a number, got 'soon'"),
        ("ENGINED_ENABLE_PREFIX_CACHING", "maybe", "engine.enable_prefix_caching: expected a bool"),
        ("ENGINED_HTTP_PORT", "eighty", "http_port: expected an integer, got 'eighty'"),
    ],
)
def test_unparsable_env_value_names_key_and_variable(name: str, text: str, message: str) -> None:
    with raises(message) as info:
        load(env={name: text})
    assert info.value.key is not None and message.startswith(info.value.key)
    assert str(info.value).endswith(f"(from {name})")


def test_unknown_flag_key() -> None:
    with raises("engine.blok_size: not a setting a flag can set"):
        load(flags={"engine.blok_size": 1})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with raises(f"config file {tmp_path / 'absent.toml'}: not found"):
        load_config(config_path=tmp_path / "absent.toml", env={}, flags={})
    with raises("config file ") as info:
        load("drain_timeout = = 1\n", tmp_path=tmp_path)
    assert "engined.toml" in str(info.value)


def test_engine_not_a_table(tmp_path: Path) -> None:
    with raises("engine: must be a table"):
        load('engine = "vllm"\n', tmp_path=tmp_path)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"engine.num_gpu_blocks": 0},
            "engine.num_gpu_blocks: num_gpu_blocks must be >= 1, got 0 (from --num-gpu-blocks)",
        ),
        (
            {"engine.engine_type": "tpu"},
            "engine.engine_type: Invalid engine_type 'tpu'. Must be 'vllm', 'sglang', or "
            "'trtllm'. (from --engine-type)",
        ),
        (
            {"engine.block_size": 1},
            "engine.block_size: the vLLM/TRT-LLM scheduler requires block_size to be at least 2",
        ),
        (
            {"engine.aic_nextn_accept_rates": "0.5"},
            "engine.aic_nextn_accept_rates: aic_nextn_accept_rates requires aic_nextn",
        ),
        (
            {"engine.aic_nextn": 2, "engine.aic_nextn_accept_rates": "0.5,x"},
            "engine.aic_nextn_accept_rates: invalid aic_nextn_accept_rates value",
        ),
        (
            {"engine.drafting_slots": 1},
            "engine.drafting_slots: drafting_slots requires aic_nextn",
        ),
        (
            {"engine.aic_nextn": 1, "engine.eagle_block_drop": True},
            "engine.eagle_block_drop: eagle_block_drop requires aic_nextn and "
            "lookahead_block_hashes = false",
        ),
        (
            {"engine.aic_nextn": 2, "engine.drafting_slots": -1},
            "engine.drafting_slots: ",
        ),
        ({"engine.seed": True}, "engine.seed: Expected `int`, got `bool` - at `$.seed`"),
        (
            {"engine.num_g2_blocks": 8, "engine.num_g3_blocks": 8},
            "engine.kv_bytes_per_token: G3/G4 offload requires kv_bytes_per_token so mocker "
            "can size lower-tier transfers",
        ),
    ],
)
def test_engine_errors_name_the_key(flags: dict[str, Any], message: str) -> None:
    with raises(message) as info:
        load(flags=flags)
    assert info.value.key == message.split(":")[0]


def test_engine_error_names_toml_file_and_sub_table(tmp_path: Path) -> None:
    toml = '[engine]\nengine_type = "sglang"\n[engine.sglang]\npage_size = 0\n'
    with raises("engine.sglang.page_size: sglang.page_size must be >= 1, got 0") as info:
        load(toml, tmp_path=tmp_path)
    assert str(tmp_path / "engined.toml") in str(info.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"kv_replay_buffer": 0}, "kv_replay_buffer: Expected `int` >= 1, got 0"),
        ({"max_queued_requests": -1}, "max_queued_requests: Expected `int` >= 0"),
        ({"drain_timeout": -1.0}, "drain_timeout: Expected `float` >= 0.0"),
        ({"drain_timeout": "inf"}, "drain_timeout: must be finite, got inf"),
        ({"http_port": 0}, "http_port: Expected `int` >= 1"),
        ({"http_port": "65536"}, "http_port: Expected `int` <= 65535"),
        ({"model_name": ""}, "model_name: Expected `str` of length >= 1"),
        ({"log_level": "loud"}, "log_level: Invalid enum value 'loud'; expected one of debug, "),
        ({"kv_events_format": "json"}, "kv_events_format: Invalid enum value 'json'"),
        ({"kv_events_topic": 3}, "kv_events_topic: Expected `str`, got `int`"),
    ],
)
def test_daemon_errors_name_the_key(flags: dict[str, Any], message: str) -> None:
    with raises(message) as info:
        load(flags=flags)
    assert info.value.key == message.split(":")[0]


def test_error_names_the_layer_that_set_the_value(tmp_path: Path) -> None:
    with raises("kv_replay_buffer: Expected `int` >= 1, got 0 (from ENGINED_KV_REPLAY_BUFFER)"):
        load(env={"ENGINED_KV_REPLAY_BUFFER": "0"})
    with raises(f"(from {tmp_path / 'engined.toml'})"):
        load("kv_replay_buffer = 0\n", tmp_path=tmp_path)
    with raises("kv_replay_buffer: Expected `int` >= 1, got 0 (from --kv-replay-buffer)"):
        load(env={"ENGINED_KV_REPLAY_BUFFER": "5"}, flags={"kv_replay_buffer": 0})


# --- endpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://collector.local:9000", 2, "tcp://collector.local:9002"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://[fe80::1%eth0]:1", 0, "tcp://[fe80::1%eth0]:1"),
        ("ipc:///tmp/engined/kv", 0, "ipc:///tmp/engined/kv"),
        ("ipc:///tmp/engined/kv", 2, "ipc:///tmp/engined/kv-2"),
        ("tcp://h:65534", 1, "tcp://h:65535"),
    ],
)
def test_endpoint_for_rank(endpoint: str, rank: int, expected: str) -> None:
    assert endpoint_for_rank(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("udp://127.0.0.1:5557", "must start with tcp:// or ipc://"),
        ("inproc://kv", "must start with tcp:// or ipc://"),
        ("127.0.0.1:5557", "must start with tcp:// or ipc://"),
        ("tcp://127.0.0.1", "must be tcp://HOST:PORT"),
        ("tcp://:5557", "must be tcp://HOST:PORT"),
        ("tcp://127.0.0.1:*", "port must be a number in 1..65535, got '*'"),
        ("tcp://127.0.0.1:0", "port must be a number in 1..65535, got '0'"),
        ("tcp://127.0.0.1:65536", "port must be a number in 1..65535"),
        ("tcp://::1:5557", "write IPv6 hosts in brackets"),
        ("tcp://[::1:5557", "unterminated IPv6 address"),
        ("ipc://", "has no path"),
        ("tcp://h:65535", "port of rank 1 exceeds 65535"),
    ],
)
def test_endpoint_for_rank_refusals(endpoint: str, message: str) -> None:
    with raises(message):
        endpoint_for_rank(endpoint, 1)


def test_endpoint_for_rank_negative_rank() -> None:
    with pytest.raises(ValueError, match="rank must be >= 0"):
        endpoint_for_rank("tcp://h:1", -1)


def test_endpoints_are_validated_with_their_key() -> None:
    with raises("control_endpoint: 'udp://x:1' must start with tcp:// or ipc://"):
        load(flags={"control_endpoint": "udp://x:1"})
    with raises("fpm_endpoint: 'tcp://h' must be tcp://HOST:PORT (from ENGINED_FPM_ENDPOINT)"):
        load(env={"ENGINED_FPM_ENDPOINT": "tcp://h"})


def test_per_rank_ports_must_exist() -> None:
    flags = {"kv_events_endpoint": "tcp://127.0.0.1:65534", "engine.dp_size": 3}
    with raises("kv_events_endpoint: ranks 0..2 need ports 65534..65536, beyond 65535"):
        load(flags=flags)
    # the control socket is not per rank
    assert load(flags={"control_endpoint": "tcp://h:65535", "engine.dp_size": 3})


def test_bound_endpoints_must_not_collide() -> None:
    flags = {"engine.dp_size": 2, "kv_replay_endpoint": "tcp://127.0.0.1:5558"}
    with raises(
        "kv_replay_endpoint: tcp://127.0.0.1:5558 (kv_replay_endpoint rank 0) is also used by "
        "kv_events_endpoint rank 1"
    ):
        load(flags=flags)
    with raises("fpm_endpoint: tcp://*:5555 (fpm_endpoint) is also used by control_endpoint"):
        load(flags={"fpm_endpoint": "tcp://*:5555"})
    with raises("fpm_endpoint: ipc:///tmp/x (fpm_endpoint) is also used by control_endpoint"):
        load(flags={"control_endpoint": "ipc:///tmp/x", "fpm_endpoint": "ipc:///tmp/x"})
    # other hosts, or a KV PUB that connects rather than binds, do not collide
    assert load(flags={"engine.dp_size": 2, "kv_replay_endpoint": "tcp://10.0.0.1:5558"})
    assert load(flags={"kv_events_connect": True, "kv_events_endpoint": "tcp://127.0.0.1:5555"})


# --- printing ---------------------------------------------------------------------------------


def round_trip(config: DaemonConfig, tmp_path: Path) -> DaemonConfig:
    text = dump_config(config)
    tomllib.loads(text)  # valid TOML on its own
    path = tmp_path / "printed.toml"
    path.write_text(text)
    return load_config(config_path=path, env={}, flags={})


def test_dump_config_of_defaults_round_trips(tmp_path: Path) -> None:
    text = dump_config(DaemonConfig())
    assert text.index("model_name =") < text.index("[engine]") < text.index("block_size = 64")
    assert "# kv_replay_endpoint = (unset)\n" in text
    assert round_trip(DaemonConfig(), tmp_path) == DaemonConfig()


def test_dump_config_round_trips(tmp_path: Path) -> None:
    engine = {
        "engine_type": "trtllm",
        "max_num_seqs": None,
        "aic_nextn": 2,
        "aic_nextn_accept_rates": "0.9",
        "kv_transfer_bandwidth": 12.5,
        "speedup_ratio": 1e-7,
        "sglang": {"page_size": 4, "schedule_policy": "lpm"},
        "reasoning": {"start_token_id": 7, "name": 'a "b"'},
        "seed": 2**40,
    }
    config = load(
        flags={"fpm_endpoint": None, "kv_events_topic": 'k"v\\\n\x01\x7f', "http_port": 9100},
        tmp_path=tmp_path,
    )
    config = msgspec.structs.replace(config, engine=EngineArgs.from_mapping(engine))
    text = dump_config(config)
    assert 'fpm_endpoint = ""' in text and 'max_num_seqs = ""' in text
    assert "[engine.sglang]" in text and "# [engine.trtllm] (unset)" in text
    assert round_trip(config, tmp_path) == config


# --- one declaration per setting --------------------------------------------------------------

ISSUE_FLAGS = {
    "--block-size": "engine.block_size",
    "--num-gpu-blocks": "engine.num_gpu_blocks",
    "--max-num-seqs": "engine.max_num_seqs",
    "--max-num-batched-tokens": "engine.max_num_batched_tokens",
    "--enable-prefix-caching": "engine.enable_prefix_caching",
    "--enable-chunked-prefill": "engine.enable_chunked_prefill",
    "--speedup-ratio": "engine.speedup_ratio",
    "--data-parallel-size": "engine.dp_size",
    "--worker-type": "engine.worker_type",
    "--engine-type": "engine.engine_type",
    "--preemption-mode": "engine.preemption_mode",
    "--kv-bytes-per-token": "engine.kv_bytes_per_token",
    "--kv-transfer-bandwidth": "engine.kv_transfer_bandwidth",
    "--nextn": "engine.aic_nextn",
    "--nextn-accept-rates": "engine.aic_nextn_accept_rates",
    "--seed": "engine.seed",
    "--vocab-size": "engine.vocab_size",
    "--excluded-token-ids": "engine.excluded_token_ids",
    "--prefix-hit-rule": "engine.prefix_hit_rule",
    "--semantics": "engine.semantics",
    "--scheduling-policy": "engine.scheduling_policy",
    "--scheduler-reserve-full-isl": "engine.scheduler_reserve_full_isl",
    "--async-scheduling": "engine.async_scheduling",
    "--lookahead-block-hashes": "engine.lookahead_block_hashes",
    "--drafting-slots": "engine.drafting_slots",
    "--eagle-block-drop": "engine.eagle_block_drop",
    "--enable-lora": "engine.enable_lora",
    "--max-loras": "engine.max_loras",
    "--long-prefill-token-threshold": "engine.long_prefill_token_threshold",
    "--watermark": "engine.watermark",
    "--max-num-active-seqs": "engine.max_num_active_seqs",
    "--max-num-scheduled-tokens": "engine.max_num_scheduled_tokens",
    "--prefill-schedule-interval": "engine.prefill_schedule_interval",
    "--long-prefill-token-threshold-adaptive": "engine.long_prefill_token_threshold_adaptive",
    "--prefix-caching-hash-algo": "engine.prefix_caching_hash_algo",
    "--kv-cache-metrics": "engine.kv_cache_metrics",
    "--kv-cache-metrics-sample": "engine.kv_cache_metrics_sample",
    "--decode-speedup-ratio": "engine.decode_speedup_ratio",
    "--kv-transfer-timing-mode": "engine.kv_transfer_timing_mode",
    "--max-model-len": "engine.max_model_len",
    "--mtp-seed": "engine.aic_mtp_seed",
    "--perf-model": "engine.perf_model",
    "--fixed-prefill-ms-per-token": "engine.fixed_prefill_ms_per_token",
    "--fixed-pass-overhead-ms": "engine.fixed_pass_overhead_ms",
    "--fixed-decode-ms-per-pass": "engine.fixed_decode_ms_per_pass",
    "--handoff-session-timeout-ms": "engine.handoff_session_timeout_ms",
    "--num-g2-blocks": "engine.num_g2_blocks",
    "--num-g3-blocks": "engine.num_g3_blocks",
    "--offload-batch-size": "engine.offload_batch_size",
    "--bandwidth-g1-to-g2-gbps": "engine.bandwidth_g1_to_g2_gbps",
    "--bandwidth-g2-to-g1-gbps": "engine.bandwidth_g2_to_g1_gbps",
    "--bandwidth-g2-to-g3-gbps": "engine.bandwidth_g2_to_g3_gbps",
    "--bandwidth-g3-to-g2-gbps": "engine.bandwidth_g3_to_g2_gbps",
    "--model-name": "model_name",
    "--control-endpoint": "control_endpoint",
    "--operator-endpoint": "operator_endpoint",
    "--max-connections": "max_connections",
    "--curve-secret-key-file": "curve_secret_key_file",
    "--curve-authorized-keys-file": "curve_authorized_keys_file",
    "--curve-publishers": "curve_publishers",
    "--kv-events-endpoint": "kv_events_endpoint",
    "--kv-events-connect": "kv_events_connect",
    "--kv-replay-endpoint": "kv_replay_endpoint",
    "--kv-replay-buffer": "kv_replay_buffer",
    "--kv-replay-client-bytes": "kv_replay_client_bytes",
    "--kv-events-buffer-bytes": "kv_events_buffer_bytes",
    "--kv-events-topic": "kv_events_topic",
    "--kv-events-format": "kv_events_format",
    "--fpm-endpoint": "fpm_endpoint",
    "--worker-id": "worker_id",
    "--max-queued-requests": "max_queued_requests",
    "--control-inflight-bytes": "control_inflight_bytes",
    "--control-unread-bytes": "control_unread_bytes",
    "--drain-timeout": "drain_timeout",
    "--rank-processes": "rank_processes",
    "--realtime-priority": "realtime_priority",
    "--log-format": "log_format",
    "--log-level": "log_level",
    "--http-port": "http_port",
    "--http-host": "http_host",
    "--api-key": "api_key",
    "--api-key-file": "api_key_file",
    "--api-key-metrics": "api_key_metrics",
    # Issue 22: `vllm serve`'s own spellings.
    "--model": "model",
    "--model-aliases": "model_aliases",
    "--tokenizer": "tokenizer",
    "--lora-modules": "lora_modules",
    "--host": "api_host",
    "--port": "api_port",
    "--api-server-count": "api_server_count",
    "--enable-prompt-tokens-details": "enable_prompt_tokens_details",
    "--max-logprobs": "max_logprobs",
    "--stream-interval": "stream_interval",
    "--max-num-queued-reqs": "max_num_queued_reqs",
    "--max-num-queued-tokens": "max_num_queued_tokens",
    "--enable-server-load-tracking": "enable_server_load_tracking",
    "--enable-request-id-headers": "enable_request_id_headers",
    "--enable-force-include-usage": "enable_force_include_usage",
    "--return-tokens-as-token-ids": "return_tokens_as_token_ids",
    "--response-role": "response_role",
    "--sse-keep-alive-interval": "sse_keep_alive_interval",
    "--allowed-origins": "allowed_origins",
    "--allowed-methods": "allowed_methods",
    "--allowed-headers": "allowed_headers",
    "--allow-credentials": "allow_credentials",
}


def test_issue_flags_map_to_their_keys() -> None:
    assert {flag.name: flag.key for flag in FLAGS} == ISSUE_FLAGS


def test_every_daemon_field_has_a_flag_and_an_env_name() -> None:
    keys = {flag.key for flag in FLAGS}
    for info in msgspec.structs.fields(DaemonConfig):
        if info.name == "engine":
            continue
        assert info.name in keys
        assert env_name(info.name) == ENV_PREFIX + info.name.upper()


def test_every_scalar_engine_field_has_an_env_name() -> None:
    fields = [f.name for f in msgspec.structs.fields(EngineArgs)]
    names = [env_name(f"engine.{name}") for name in fields if f"engine.{name}" not in _TABLE_KEYS]
    assert len(names) == len(fields) - len(_TABLE_KEYS)
    assert env_name("engine.dp_size") == "ENGINED_DP_SIZE"
    assert env_name("engine.aic_nextn") == "ENGINED_AIC_NEXTN"


def test_tables_have_no_env_name() -> None:
    with pytest.raises(ValueError):
        env_name("engine.sglang")
    with pytest.raises(ValueError):
        env_name("engine")


def test_env_names_are_unique_and_load() -> None:
    daemon = [f.name for f in msgspec.structs.fields(DaemonConfig) if f.name != "engine"]
    engine = [f"engine.{f.name}" for f in msgspec.structs.fields(EngineArgs)]
    names = [env_name(key) for key in daemon + engine if key not in _TABLE_KEYS]
    assert len(names) == len(set(names))


_TABLE_KEYS = {"engine.trtllm", "engine.sglang", "engine.reasoning"}


def test_switches_and_metavars() -> None:
    by_name = {flag.name: flag for flag in FLAGS}
    switches = {flag.name for flag in FLAGS if flag.is_switch}
    assert switches == {
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--kv-events-connect",
        "--curve-publishers",
        "--api-key-metrics",
        "--scheduler-reserve-full-isl",
        "--async-scheduling",
        "--lookahead-block-hashes",
        "--eagle-block-drop",
        "--enable-lora",
        "--long-prefill-token-threshold-adaptive",
        "--enable-prompt-tokens-details",
        "--kv-cache-metrics",
        "--enable-server-load-tracking",
        "--enable-request-id-headers",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--allow-credentials",
    }
    assert by_name["--allowed-origins"].metavar == "JSON"
    assert by_name["--kv-cache-metrics-sample"].metavar == "FLOAT"
    assert by_name["--scheduler-reserve-full-isl"].negation == "--no-scheduler-reserve-full-isl"
    assert by_name["--async-scheduling"].negation == "--no-async-scheduling"
    assert by_name["--lookahead-block-hashes"].negation == "--no-lookahead-block-hashes"
    assert by_name["--enable-prefix-caching"].negation == "--no-enable-prefix-caching"
    assert by_name["--engine-type"].metavar == "[vllm|trtllm]"
    assert by_name["--log-format"].metavar == "[auto|console|json]"
    assert by_name["--block-size"].metavar == "INT"
    assert by_name["--fpm-endpoint"].metavar == "ENDPOINT"
    assert (by_name["--api-key"].metavar, by_name["--api-key-file"].metavar) == ("KEY", "PATH")
    assert by_name["--data-parallel-size"].dest == "data_parallel_size"
    assert {by_name["--seed"].section, by_name["--seed"].key} == {"engine", "engine.seed"}


# --- CORS ------------------------------------------------------------------------------------


def test_cors_settings_default_to_vllms() -> None:
    config = load()
    assert (
        config.allowed_origins,
        config.allowed_methods,
        config.allowed_headers,
        config.allow_credentials,
    ) == ((), ("*",), ("*",), False)


def test_cors_lists_are_json_on_the_command_line_and_in_the_environment(tmp_path: Path) -> None:
    flags = {"allowed_origins": '["https://a.example", "*"]', "allowed_methods": '["GET"]'}
    config = load(flags=flags)
    assert (config.allowed_origins, config.allowed_methods) == (
        ("https://a.example", "*"),
        ("GET",),
    )
    env = {"ENGINED_ALLOWED_HEADERS": '["X-Custom"]', "ENGINED_ALLOW_CREDENTIALS": "true"}
    config = load(env=env)
    assert (config.allowed_headers, config.allow_credentials) == (("X-Custom",), True)
    toml = 'allowed_origins = ["https://b.example"]\nallowed_methods = \'["POST"]\'\n'
    config = load(toml, tmp_path=tmp_path)
    assert (config.allowed_origins, config.allowed_methods) == (("https://b.example",), ("POST",))
    assert load(flags={"allowed_origins": ""}).allowed_origins == ()


@pytest.mark.parametrize(
    "text", ["https://a.example", '{"a": 1}', "[1, 2]", '["a", null]', "[", "x" * 200]
)
def test_a_cors_list_that_is_no_json_array_of_strings_is_refused(text: str) -> None:
    with raises("allowed_origins: expected a JSON array of strings, got ") as info:
        load(flags={"allowed_origins": text})
    assert info.value.key == "allowed_origins"
    assert len(str(info.value)) < 200


def test_a_cors_list_of_more_than_1024_items_is_refused() -> None:
    with raises("allowed_origins: ") as info:
        load(flags={"allowed_origins": json.dumps([f"https://{n}.example" for n in range(1025)])})
    assert info.value.key == "allowed_origins"


# --- vocabulary -------------------------------------------------------------------------------


def test_vocabulary_is_unset_by_default() -> None:
    engine = load().engine
    assert (engine.vocab_size, engine.excluded_token_ids) == (None, ())


def test_vocabulary_from_each_layer(tmp_path: Path) -> None:
    toml = "[engine]\nvocab_size = 32000\nexcluded_token_ids = [2, 0, 1]\n"
    assert load(toml, tmp_path=tmp_path).engine.excluded_token_ids == (0, 1, 2)
    env = {"ENGINED_VOCAB_SIZE": "151936", "ENGINED_EXCLUDED_TOKEN_IDS": "151643, 151645"}
    engine = load(toml, env=env, tmp_path=tmp_path).engine
    assert (engine.vocab_size, engine.excluded_token_ids) == (151936, (151643, 151645))
    flags = {"engine.vocab_size": "100", "engine.excluded_token_ids": "7"}
    engine = load(toml, env=env, flags=flags, tmp_path=tmp_path).engine
    assert (engine.vocab_size, engine.excluded_token_ids) == (100, (7,))


def test_vocabulary_empty_text_unsets(tmp_path: Path) -> None:
    toml = '[engine]\nvocab_size = ""\nexcluded_token_ids = ""\n'
    engine = load(toml, tmp_path=tmp_path).engine
    assert (engine.vocab_size, engine.excluded_token_ids) == (None, ())
    env = {"ENGINED_VOCAB_SIZE": "", "ENGINED_EXCLUDED_TOKEN_IDS": ""}
    config = load(
        "[engine]\nvocab_size = 9\nexcluded_token_ids = [1]\n", env=env, tmp_path=tmp_path
    )
    assert (config.engine.vocab_size, config.engine.excluded_token_ids) == (None, ())


def test_excluded_ids_take_text_in_toml(tmp_path: Path) -> None:
    engine = load('[engine]\nexcluded_token_ids = "3,1"\n', tmp_path=tmp_path).engine
    assert engine.excluded_token_ids == (1, 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"engine.vocab_size": "0"}, "engine.vocab_size: vocab_size must be in [1, 4294967296]"),
        ({"engine.vocab_size": "big"}, "engine.vocab_size: expected an integer, got 'big'"),
        (
            {"engine.excluded_token_ids": "1,,2"},
            "engine.excluded_token_ids: expected comma-separated integers, got '1,,2' "
            "(from --excluded-token-ids)",
        ),
        (
            {"engine.excluded_token_ids": "-1"},
            "engine.excluded_token_ids: excluded_token_ids[0] must be >= 0, got -1",
        ),
        (
            {"engine.vocab_size": "4", "engine.excluded_token_ids": "1,4"},
            "engine.excluded_token_ids: excluded_token_ids[1] must be < vocab_size (4), got 4",
        ),
        (
            {"engine.vocab_size": "2", "engine.excluded_token_ids": "0,1"},
            "engine.excluded_token_ids: excluded_token_ids leave none of the 2 ids",
        ),
        (
            {"engine.excluded_token_ids": ",".join(map(str, range(8193)))},
            "engine.excluded_token_ids: excluded_token_ids has 8193 ids, more than the 8192 "
            "allowed (a model's EOS and special tokens are far fewer) (from --excluded-token-ids)",
        ),
    ],
)
def test_vocabulary_errors_name_the_key(flags: dict[str, Any], message: str) -> None:
    with raises(message) as info:
        load(flags=flags)
    assert info.value.key == message.split(":")[0]


def test_vocabulary_toml_error_names_the_file(tmp_path: Path) -> None:
    with raises("engine.excluded_token_ids: expected comma-separated integers, got 'x' (from "):
        load('[engine]\nexcluded_token_ids = "x"\n', tmp_path=tmp_path)


def test_vocabulary_print_config_round_trips(tmp_path: Path) -> None:
    config = load(flags={"engine.vocab_size": "50", "engine.excluded_token_ids": "4,2"})
    text = dump_config(config)
    assert "vocab_size = 50\n" in text and "excluded_token_ids = [2, 4]\n" in text
    assert round_trip(config, tmp_path) == config
    unset = dump_config(DaemonConfig())
    assert "# vocab_size = (unset)\n" in unset and "excluded_token_ids = []\n" in unset


def test_vocabulary_flag_metavars() -> None:
    by_name = {flag.name: flag for flag in FLAGS}
    assert by_name["--vocab-size"].metavar == "INT"
    assert by_name["--excluded-token-ids"].metavar == "INT,..."


# --- prefix-hit rule --------------------------------------------------------------------------


def test_prefix_hit_rule_defaults_to_vllm() -> None:
    assert load().engine.prefix_hit_rule is PrefixHitRule.VLLM


def test_prefix_hit_rule_from_each_layer(tmp_path: Path) -> None:
    toml = '[engine]\nprefix_hit_rule = "mocker-1.3.0"\n'
    assert load(toml, tmp_path=tmp_path).engine.prefix_hit_rule is PrefixHitRule.MOCKER_1_3_0
    env = {"ENGINED_PREFIX_HIT_RULE": "VLLM"}
    assert load(toml, env=env, tmp_path=tmp_path).engine.prefix_hit_rule is PrefixHitRule.VLLM
    flags = {"engine.prefix_hit_rule": "mocker-1.3.0"}
    engine = load(toml, env=env, flags=flags, tmp_path=tmp_path).engine
    assert engine.prefix_hit_rule is PrefixHitRule.MOCKER_1_3_0


@pytest.mark.parametrize(
    ("layer", "source"),
    [
        ({"env": {"ENGINED_PREFIX_HIT_RULE": "sglang"}}, "ENGINED_PREFIX_HIT_RULE"),
        ({"flags": {"engine.prefix_hit_rule": "sglang"}}, "--prefix-hit-rule"),
    ],
)
def test_prefix_hit_rule_refusal_names_key_and_layer(layer: dict[str, Any], source: str) -> None:
    message = (
        "engine.prefix_hit_rule: Invalid prefix_hit_rule 'sglang'. Must be 'vllm' or "
        f"'mocker-1.3.0'. (from {source})"
    )
    with raises(message) as info:
        load(**layer)
    assert info.value.key == "engine.prefix_hit_rule"


def test_prefix_hit_rule_toml_empty_string_is_refused(tmp_path: Path) -> None:
    """Not optional: "" is no rule, and the message says which ones exist."""
    with raises("engine.prefix_hit_rule: Invalid prefix_hit_rule ''"):
        load('[engine]\nprefix_hit_rule = ""\n', tmp_path=tmp_path)


def test_prefix_hit_rule_print_config_round_trips(tmp_path: Path) -> None:
    assert 'prefix_hit_rule = "vllm"\n' in dump_config(DaemonConfig())
    config = load(flags={"engine.prefix_hit_rule": "mocker-1.3.0"})
    assert 'prefix_hit_rule = "mocker-1.3.0"\n' in dump_config(config)
    assert round_trip(config, tmp_path) == config


def test_prefix_hit_rule_flag_lists_its_choices() -> None:
    flag = next(flag for flag in FLAGS if flag.name == "--prefix-hit-rule")
    assert flag.metavar == "[vllm|mocker-1.3.0]"


# --- vLLM block hash algorithm ----------------------------------------------------------------


def test_prefix_caching_hash_algo_defaults_to_vllms_sha256() -> None:
    assert load().engine.prefix_caching_hash_algo is HashAlgo.SHA256


def test_prefix_caching_hash_algo_from_each_layer(tmp_path: Path) -> None:
    toml = '[engine]\nprefix_caching_hash_algo = "xxhash"\n'
    assert load(toml, tmp_path=tmp_path).engine.prefix_caching_hash_algo is HashAlgo.XXHASH
    env = {"ENGINED_PREFIX_CACHING_HASH_ALGO": "sha256_cbor"}
    engine = load(toml, env=env, tmp_path=tmp_path).engine
    assert engine.prefix_caching_hash_algo is HashAlgo.SHA256_CBOR
    flags = {"engine.prefix_caching_hash_algo": "xxhash_cbor"}
    engine = load(toml, env=env, flags=flags, tmp_path=tmp_path).engine
    assert engine.prefix_caching_hash_algo is HashAlgo.XXHASH_CBOR


@pytest.mark.parametrize(
    ("layer", "source"),
    [
        ({"env": {"ENGINED_PREFIX_CACHING_HASH_ALGO": "md5"}}, "ENGINED_PREFIX_CACHING_HASH_ALGO"),
        ({"flags": {"engine.prefix_caching_hash_algo": "md5"}}, "--prefix-caching-hash-algo"),
    ],
)
def test_prefix_caching_hash_algo_refusal_has_vllms_words(
    layer: dict[str, Any], source: str
) -> None:
    message = (
        "engine.prefix_caching_hash_algo: Invalid prefix_caching_hash_algo 'md5'. Input should "
        f"be 'sha256', 'sha256_cbor', 'xxhash' or 'xxhash_cbor'. (from {source})"
    )
    with raises(message) as info:
        load(**layer)
    assert info.value.key == "engine.prefix_caching_hash_algo"


# --- options only vLLM's scheduler has ----------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "key", "source"),
    [
        ({"engine.async_scheduling": True}, "engine.async_scheduling", "--async-scheduling"),
        (
            {"engine.lookahead_block_hashes": False},
            "engine.lookahead_block_hashes",
            "--lookahead-block-hashes",
        ),
        (
            {"engine.aic_nextn": 2, "engine.drafting_slots": 1},
            "engine.drafting_slots",
            "--drafting-slots",
        ),
        (
            {"engine.scheduling_policy": "priority"},
            "engine.scheduling_policy",
            "--scheduling-policy",
        ),
    ],
)
def test_vllm_only_options_are_refused_without_vllm_semantics(
    flags: dict[str, Any], key: str, source: str
) -> None:
    with raises(f"{key}: ") as info:
        load(flags={"engine.semantics": "mocker-1.3.0", **flags})
    assert info.value.key == key
    assert "needs vLLM semantics" in str(info.value)
    assert str(info.value).endswith(f"(from {source})")


def test_async_scheduling_from_every_layer(tmp_path: Path) -> None:
    assert load().engine.async_scheduling is False
    assert load("[engine]\nasync_scheduling = true\n", tmp_path=tmp_path).engine.async_scheduling
    assert load(env={"ENGINED_ASYNC_SCHEDULING": "yes"}).engine.async_scheduling
    with raises("engine.async_scheduling: Expected `bool`, got `int`"):
        load("[engine]\nasync_scheduling = 3\n", tmp_path=tmp_path)
    with raises("engine.async_scheduling: expected a boolean"):
        load(env={"ENGINED_ASYNC_SCHEDULING": "maybe"})


# --- one pass: every problem at once ---------------------------------------------------------


def test_every_bad_key_is_reported_in_one_pass(tmp_path: Path) -> None:
    toml = "drain_timeout = -1.0\nbogus = 1\n[engine]\nblock_size = 1\nnum_gpu_blocks = 0\n"
    source = tmp_path / "engined.toml"
    with pytest.raises(ConfigError) as info:
        load(
            toml,
            tmp_path=tmp_path,
            env={"ENGINED_MAX_NUM_SEQS": "many", "ENGINED_NOPE": "1"},
            flags={"engine.seed": "-3", "realtime_priority": "5", "engine.speedup_ratio": "0"},
        )
    expected = [
        f"bogus: unknown key in {source}",
        "engine.max_num_seqs: expected an integer, got 'many' (from ENGINED_MAX_NUM_SEQS)",
        "ENGINED_NOPE: unknown environment variable (did you mean ENGINED_MODEL?)",
        f"drain_timeout: Expected `float` >= 0.0, got -1.0 (from {source})",
        f"engine.num_gpu_blocks: num_gpu_blocks must be >= 1, got 0 (from {source})",
        "engine.seed: seed must be >= 0, got -3 (from --seed)",
        "engine.block_size: the vLLM/TRT-LLM scheduler requires block_size to be at least 2 "
        f"for engine_type=Vllm, got block_size=1 (from {source})",
        "realtime_priority: needs engine.speedup_ratio > 0: an unpaced daemon never sleeps, and "
        "at real-time priority it would hold its cores against every other process "
        "(from --realtime-priority)",
    ]
    assert str(info.value).splitlines() == expected
    assert [str(p) for p in info.value.problems] == expected
    assert [p.key for p in info.value.problems] == [
        "bogus",
        "engine.max_num_seqs",
        None,
        "drain_timeout",
        "engine.num_gpu_blocks",
        "engine.seed",
        "engine.block_size",
        "realtime_priority",
    ]
    assert info.value.key == "bogus"


def test_queue_limits_take_vllms_bounds_and_empty_for_none() -> None:
    """`--max-num-queued-reqs` and `--max-num-queued-tokens`: unset (no limit) by default,
    0 and up as vLLM takes them (`ge=0`), "" for no limit."""
    keys = ("max_num_queued_reqs", "max_num_queued_tokens")
    assert [getattr(load(), key) for key in keys] == [None, None]
    assert [getattr(load(flags=dict.fromkeys(keys, "0")), key) for key in keys] == [0, 0]
    assert [getattr(load(flags=dict.fromkeys(keys, "")), key) for key in keys] == [None, None]
    with pytest.raises(ConfigError) as info:
        load(flags=dict.fromkeys(keys, "-1"))
    assert str(info.value).splitlines() == [
        "max_num_queued_reqs: Expected `int` >= 0, got -1 (from --max-num-queued-reqs)",
        "max_num_queued_tokens: Expected `int` >= 0, got -1 (from --max-num-queued-tokens)",
    ]


def test_vllms_human_readable_counts() -> None:
    """vLLM's spellings of its counts on the command line: `k` decimal, `K` binary,
    decimals with decimal suffixes only; `--max-model-len auto` (or -1) is the model's."""
    cases = {"8k": 8000, "2K": 2048, "25.6k": 25_600, "1M": 2**20, "1g": 10**9, "77": 77}
    for text, value in cases.items():
        loaded = load(flags={"engine.max_num_batched_tokens": text})
        assert loaded.engine.max_num_batched_tokens == value, text
        assert load(flags={"max_num_queued_tokens": text}).max_num_queued_tokens == value
    assert load(flags={"engine.max_model_len": "32k"}).engine.max_model_len == 32_000
    for auto in ("auto", "AUTO", "-1"):
        assert load(flags={"engine.max_model_len": auto}).engine.max_model_len is None
    with pytest.raises(ConfigError) as info:
        load(flags={"engine.max_num_batched_tokens": "1.5K", "engine.max_num_seqs": "2k"})
    assert str(info.value).splitlines() == [
        "engine.max_num_batched_tokens: Decimals are not allowed with binary suffixes like K. "
        "Did you mean to use 1.5k instead? (from --max-num-batched-tokens)",
        # Only where vLLM reads them so.
        "engine.max_num_seqs: expected an integer, got '2k' (from --max-num-seqs)",
    ]


def test_one_problem_is_its_own_error() -> None:
    with pytest.raises(ConfigError) as info:
        load(flags={"engine.num_gpu_blocks": 0})
    assert info.value.problems == (info.value,)
    assert str(info.value) == (
        "engine.num_gpu_blocks: num_gpu_blocks must be >= 1, got 0 (from --num-gpu-blocks)"
    )


def test_a_refused_sub_table_key_is_reported_once_and_the_rest_still_judged(
    tmp_path: Path,
) -> None:
    toml = '[engine]\nengine_type = "sglang"\n[engine.sglang]\npage_size = "x"\n'
    with pytest.raises(ConfigError) as info:
        load(toml, tmp_path=tmp_path)
    source = tmp_path / "engined.toml"
    assert str(info.value).splitlines() == [
        "engine.sglang.page_size: Expected `int | null`, got `str` - at `$.sglang.page_size` "
        f"(from {source})",
        "engine.engine_type: sglang is not supported: engined simulates the vllm and trtllm "
        f"schedulers only (from {source})",
    ]


# --- lora_modules (vLLM's --lora-modules) -----------------------------------------------------


def test_lora_modules_from_every_layer(tmp_path: Path) -> None:
    """A list in TOML, one value in the environment, a list from the flag (the CLI splits
    vLLM's several values); the strings are kept as given and read by the API servers."""
    assert load().lora_modules == ()
    toml = 'lora_modules = ["a=/x", \'{"name": "b", "path": "/y"}\']\n'
    assert load(toml, tmp_path=tmp_path).lora_modules == ("a=/x", '{"name": "b", "path": "/y"}')
    assert load(env={"ENGINED_LORA_MODULES": "c=/z"}).lora_modules == ("c=/z",)
    assert load(flags={"lora_modules": ("d=/p", "e=/q")}).lora_modules == ("d=/p", "e=/q")


def test_lora_modules_are_read_as_vllm_reads_them() -> None:
    """vLLM's LoRAParserAction: `name=path` when there is a `=` and no `,` (split at the
    first `=`, even inside what looks like JSON), else a JSON object; "" and "None" skipped;
    a `base_model_name` that is not a string is no base model."""
    assert parse_lora_modules(
        [
            "a=/x",
            "b=c=d",
            "",
            "None",
            '{"name": "e", "path": "/f", "base_model_name": "m", "is_3d_lora_weight": true}',
            '{"name": "g", "path": "/h", "base_model_name": 5}',
            '{"name":"i=j"}',
            "=",
        ]
    ) == (
        LoraModule("a", "/x"),
        LoraModule("b", "c=d"),
        LoraModule("e", "/f", "m"),
        LoraModule("g", "/h"),
        LoraModule('{"name":"i', 'j"}'),
        LoraModule("", ""),
    )


# vLLM 0.33's `vllm serve ... --lora-modules VALUE` refusals, as its parser printed them.
_MODULE = "vllm.entrypoints.openai.models.protocol.LoRAModulePath()"
LORA_PARSE_ERRORS = [
    ("notjson", "Invalid JSON format for --lora-modules: notjson"),
    ("a=/x,y", "Invalid JSON format for --lora-modules: a=/x,y"),
    ('"s', 'Invalid JSON format for --lora-modules: "s'),
    (
        "[1]",
        f"Invalid fields for --lora-modules: [1] - {_MODULE} argument after ** must be a "
        "mapping, not list",
    ),
    (
        "null",
        f"Invalid fields for --lora-modules: null - {_MODULE} argument after ** must be a "
        "mapping, not NoneType",
    ),
    (
        "true",
        f"Invalid fields for --lora-modules: true - {_MODULE} argument after ** must be a "
        "mapping, not bool",
    ),
    (
        '{"name":"a"}',
        'Invalid fields for --lora-modules: {"name":"a"} - LoRAModulePath.__init__() missing '
        "1 required positional argument: 'path'",
    ),
    (
        "{}",
        "Invalid fields for --lora-modules: {} - LoRAModulePath.__init__() missing 2 required "
        "positional arguments: 'name' and 'path'",
    ),
    (
        '{"name":"a","path":"/p","x":1}',
        'Invalid fields for --lora-modules: {"name":"a","path":"/p","x":1} - '
        "LoRAModulePath.__init__() got an unexpected keyword argument 'x'",
    ),
    (
        '{"path":"p","y":2}',
        'Invalid fields for --lora-modules: {"path":"p","y":2} - LoRAModulePath.__init__() '
        "got an unexpected keyword argument 'y'",
    ),
    # engined's: vLLM takes these here and fails at start-up in pydantic's words.
    (
        '{"name":1,"path":"/p"}',
        'Invalid fields for --lora-modules: {"name":1,"path":"/p"} - \'name\' must be a '
        "string, got int",
    ),
]


@pytest.mark.parametrize(("value", "message"), LORA_PARSE_ERRORS)
def test_lora_module_parse_errors_are_vllms(value: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_lora_modules(["ok=/fine", value])
    assert str(info.value) == message
    with pytest.raises(ConfigError) as error:
        load(env={"ENGINED_LORA_MODULES": value})
    assert str(error.value) == f"lora_modules: {message} (from ENGINED_LORA_MODULES)"
