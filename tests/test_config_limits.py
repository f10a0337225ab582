"""The configuration of issue 10's and 21's bounds, and `--engine-type sglang` refused.

A refused setting must exit 2 (CONFIG_ERROR) before anything starts: under systemd an exit 1
(a crash) means a restart loop, exit 2 a configuration to fix.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engined.cli import CONFIG_ERROR, app
from engined.config import ENV_PREFIX, ConfigError, DaemonConfig, load_config


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def test_bounds_have_finite_defaults() -> None:
    config = DaemonConfig()
    assert config.max_queued_requests == 4096
    assert config.kv_events_buffer_bytes == 64 * 1024 * 1024
    assert config.kv_replay_client_bytes == 8 * 1024 * 1024
    assert config.control_inflight_bytes == 256 * 1024 * 1024
    assert config.control_unread_bytes == 64 * 1024 * 1024


def test_bounds_follow_the_layers(tmp_path: Path) -> None:
    path = tmp_path / "engined.toml"
    path.write_text("kv_events_buffer_bytes = 1000\nkv_replay_client_bytes = 2000\n")
    config = load_config(
        config_path=path,
        env={"ENGINED_KV_REPLAY_CLIENT_BYTES": "3000", "ENGINED_MAX_QUEUED_REQUESTS": "7"},
        flags={"max_queued_requests": "8"},
    )
    assert config.kv_events_buffer_bytes == 1000  # TOML
    assert config.kv_replay_client_bytes == 3000  # environment over TOML
    assert config.max_queued_requests == 8  # flag over environment


@pytest.mark.parametrize(
    "key",
    [
        "kv_events_buffer_bytes",
        "kv_replay_client_bytes",
        "control_inflight_bytes",
        "control_unread_bytes",
    ],
)
def test_byte_bounds_must_be_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: Expected `int` >= 1"):
        load_config(config_path=None, env={}, flags={key: "0"})


def test_serve_refuses_sglang_as_a_bad_setting() -> None:
    result = CliRunner().invoke(app, ["serve", "--engine-type", "sglang"])
    assert result.exit_code == CONFIG_ERROR
    assert "engine.engine_type: sglang is not supported" in result.output
    assert "(from --engine-type)" in result.output


def test_sglang_is_refused_from_every_layer(tmp_path: Path) -> None:
    path = tmp_path / "engined.toml"
    path.write_text('[engine]\nengine_type = "sglang"\n')
    with pytest.raises(ConfigError, match=r"^engine\.engine_type: sglang .*\(from .*toml\)$"):
        load_config(config_path=path, env={}, flags={})
    with pytest.raises(ConfigError, match=r"\(from ENGINED_ENGINE_TYPE\)$"):
        load_config(config_path=None, env={"ENGINED_ENGINE_TYPE": "sglang"}, flags={})


def test_print_config_shows_the_bounds() -> None:
    flags = ["--kv-events-buffer-bytes", "5", "--control-inflight-bytes", "6"]
    flags += ["--control-unread-bytes", "7"]
    result = CliRunner().invoke(app, ["serve", "--print-config", *flags])
    assert result.exit_code == 0, result.output
    config = tomllib.loads(result.stdout)
    assert config["kv_events_buffer_bytes"] == 5
    assert config["control_inflight_bytes"] == 6
    assert config["control_unread_bytes"] == 7
    assert config["kv_replay_client_bytes"] == 8 * 1024 * 1024
    assert config["max_queued_requests"] == 4096
