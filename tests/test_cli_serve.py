"""`engined serve`: options reach the config layers, errors become exit codes."""

from __future__ import annotations

import os
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner, Result

from engined.cli import CONFIG_ERROR, app
from engined.config import ENV_PREFIX, FLAGS, DaemonConfig


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests own every ENGINED_* variable; one left in the shell would fail them."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, ["serve", *args], env=env)


def printed(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = invoke("--print-config", *args, env=env)
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.stdout)


def test_print_config_defaults() -> None:
    config = printed()
    assert config["control_endpoint"] == "tcp://127.0.0.1:5555"
    assert config["engine"]["block_size"] == 64
    assert "kv_replay_endpoint" not in config


def test_flags_set_engine_and_daemon_keys() -> None:
    config = printed(
        "--block-size",
        "16",
        "--data-parallel-size",
        "2",
        "--no-enable-prefix-caching",
        "--nextn",
        "2",
        "--nextn-accept-rates",
        "0.9",
        "--engine-type",
        "TRTLLM",
        "--model-name",
        "m",
        "--drain-timeout",
        "2.5",
        "--kv-replay-endpoint",
        "tcp://127.0.0.1:6000",
        "--fpm-endpoint",
        "",
        "--kv-events-connect",
        "--log-format",
        "json",
    )
    engine = config["engine"]
    assert (engine["block_size"], engine["dp_size"], engine["engine_type"]) == (16, 2, "trtllm")
    assert engine["enable_prefix_caching"] is False
    assert (engine["aic_nextn"], engine["aic_nextn_accept_rates"]) == (2, "0.9,0")
    assert (config["model_name"], config["drain_timeout"]) == ("m", 2.5)
    assert config["kv_replay_endpoint"] == "tcp://127.0.0.1:6000"
    assert (config["fpm_endpoint"], config["kv_events_connect"]) == ("", True)
    assert config["log_format"] == "json"


def test_precedence_toml_env_flags(tmp_path: Path) -> None:
    """1. TOML sets three keys. 2. env overrides two. 3. a flag overrides one.

    Result: each key shows the value of the last layer that set it; a switch not given on the
    command line leaves the TOML value alone.
    """
    path = tmp_path / "engined.toml"
    path.write_text(
        'log_level = "debug"\nmax_queued_requests = 5\n'
        "[engine]\nblock_size = 16\nnum_gpu_blocks = 100\nenable_chunked_prefill = false\n"
    )
    env = {"ENGINED_BLOCK_SIZE": "32", "ENGINED_MAX_QUEUED_REQUESTS": "6"}
    config = printed("--config", str(path), "--block-size", "8", env=env)
    engine = config["engine"]
    assert (engine["block_size"], engine["num_gpu_blocks"]) == (8, 100)
    assert engine["enable_chunked_prefill"] is False
    assert (config["log_level"], config["max_queued_requests"]) == ("debug", 6)


def test_printed_config_loads_back(tmp_path: Path) -> None:
    first = invoke("--print-config", "--speedup-ratio", "0", "--http-port", "9100")
    path = tmp_path / "printed.toml"
    path.write_text(first.stdout)
    again = invoke("--print-config", "--config", str(path))
    assert again.exit_code == 0 and again.stdout == first.stdout


def test_vocabulary_flags_and_env_reach_the_config(tmp_path: Path) -> None:
    config = printed("--vocab-size", "32000", "--excluded-token-ids", "2,0")
    assert (config["engine"]["vocab_size"], config["engine"]["excluded_token_ids"]) == (
        32000,
        [0, 2],
    )
    env = {"ENGINED_VOCAB_SIZE": "8", "ENGINED_EXCLUDED_TOKEN_IDS": "7"}
    first = invoke("--print-config", env=env)
    path = tmp_path / "printed.toml"
    path.write_text(first.stdout)
    again = invoke("--print-config", "--config", str(path))
    assert again.exit_code == 0 and again.stdout == first.stdout
    assert "vocab_size = 8\n" in first.stdout and "excluded_token_ids = [7]\n" in first.stdout
    result = invoke("--print-config", "--vocab-size", "4", "--excluded-token-ids", "0,1,2,3")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: engine.excluded_token_ids: ")


def test_prefix_hit_rule_flag_reaches_the_config() -> None:
    assert printed()["engine"]["prefix_hit_rule"] == "vllm"
    config = printed("--prefix-hit-rule", "mocker-1.3.0")
    assert config["engine"]["prefix_hit_rule"] == "mocker-1.3.0"
    env = {"ENGINED_PREFIX_HIT_RULE": "mocker-1.3.0"}
    assert printed(env=env)["engine"]["prefix_hit_rule"] == "mocker-1.3.0"
    result = invoke("--print-config", "--prefix-hit-rule", "full")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: engine.prefix_hit_rule: Invalid prefix_hit_rule")


def test_bad_flag_value_exits_2_naming_the_key() -> None:
    result = invoke("--print-config", "--num-gpu-blocks", "0")
    assert result.exit_code == CONFIG_ERROR == 2
    assert result.stderr.startswith("error: engine.num_gpu_blocks: ")
    assert "(from --num-gpu-blocks)" in result.stderr
    assert result.stdout == ""


def test_bad_env_value_exits_2_naming_the_key() -> None:
    result = invoke("--print-config", env={"ENGINED_DRAIN_TIMEOUT": "soon"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: drain_timeout: expected a number, got 'soon'")


def test_unknown_env_var_exits_2() -> None:
    result = invoke("--print-config", env={"ENGINED_BLOK_SIZE": "16"})
    assert result.exit_code == 2
    assert "ENGINED_BLOK_SIZE: unknown environment variable" in result.stderr


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = invoke("--config", str(tmp_path / "absent.toml"))
    assert result.exit_code == 2
    assert "not found" in result.stderr


def test_serve_runs_the_daemon_with_the_effective_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon module is replaced, so this tests the plumbing, not the daemon."""
    seen: list[DaemonConfig] = []

    def run(config: DaemonConfig) -> int:
        seen.append(config)
        return 7

    fake = types.ModuleType("engined.server.daemon")
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engined.server.daemon", fake)
    result = invoke("--max-num-seqs", "4", "--worker-id", "w")
    assert result.exit_code == 7
    assert [(c.engine.max_num_seqs, c.worker_id) for c in seen] == [(4, "w")]


def test_every_flag_is_an_option_of_serve() -> None:
    command = get_command(app)
    serve = command.commands["serve"]  # type: ignore[attr-defined]
    options: dict[str, Any] = {param.name: param for param in serve.params}
    for flag in FLAGS:
        option = options[flag.dest]
        assert option.opts == [flag.name]
        assert option.default is None
        if flag.is_switch:
            assert option.secondary_opts == [flag.negation]


def test_bare_engined_shows_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "serve" in result.output
