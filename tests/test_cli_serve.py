"""`engined serve`: options reach the config layers, errors become exit codes."""

from __future__ import annotations

import os
import subprocess
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


def fake_daemon(monkeypatch: pytest.MonkeyPatch, code: int) -> list[DaemonConfig]:
    """The daemon module replaced by one whose `run` records its configuration and returns
    `code`: the plumbing of `serve`, not the daemon."""
    seen: list[DaemonConfig] = []

    def run(config: DaemonConfig) -> int:
        seen.append(config)
        return code

    fake = types.ModuleType("engined.server.daemon")
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engined.server.daemon", fake)
    return seen


def test_serve_runs_the_daemon_with_the_effective_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = fake_daemon(monkeypatch, 7)
    result = invoke("--max-num-seqs", "4", "--worker-id", "w")
    assert result.exit_code == 7
    assert [(c.engine.max_num_seqs, c.worker_id) for c in seen] == [(4, "w")]


@pytest.mark.parametrize(
    ("args", "env", "budget"),
    [
        # vLLM raises a budget left unset to the context when chunked prefill is off: the
        # embedded model's 32768, or the context given.
        (["--no-enable-chunked-prefill"], {}, 32768),
        (["--no-enable-chunked-prefill", "--max-model-len", "20k"], {}, 20_000),
        (["--no-enable-chunked-prefill", "--max-model-len", "4096"], {}, 8192),
        # Given, by a flag or the environment, it stays (and limits a sequence).
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"], {}, 8192),
        (["--no-enable-chunked-prefill"], {"ENGINED_MAX_NUM_BATCHED_TOKENS": "4096"}, 4096),
        # With chunked prefill, or under the mocker's semantics, the default stays.
        ([], {}, 8192),
        (["--no-enable-chunked-prefill", "--prefix-hit-rule", "mocker-1.3.0"], {}, 8192),
    ],
)
def test_an_unset_budget_is_raised_to_the_context_without_chunked_prefill(
    monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], budget: int
) -> None:
    seen = fake_daemon(monkeypatch, 0)
    result = invoke(*args, env=env)
    assert result.exit_code == 0, result.output
    assert [c.engine.max_num_batched_tokens for c in seen] == [budget]


def test_a_daemon_without_a_model_or_api_server_never_loads_the_tokenizer_stack() -> None:
    """Start-up cost: tokenizers and jinja2 load only for a daemon that uses a model."""
    code = (
        "import sys, msgspec\n"
        "from engined.config import DaemonConfig\n"
        "from engined.openai.launch import with_model\n"
        "bare = msgspec.structs.replace(DaemonConfig(), api_port=None)\n"
        "assert with_model(bare, vocab_given=False, max_model_len_given=False) is bare\n"
        "print(sorted({'tokenizers', 'jinja2', 'engined.openai.tokenizer'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_flag_is_an_option_of_serve() -> None:
    command = get_command(app)
    serve = command.commands["serve"]  # type: ignore[attr-defined]
    options: dict[str, Any] = {param.name: param for param in serve.params}
    for flag in FLAGS:
        option = options[flag.dest]
        assert option.opts == [flag.name, *flag.aliases]
        assert option.default is None
        if flag.is_switch:
            assert option.secondary_opts == [flag.negation]


def test_bare_engined_shows_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "serve" in result.output


# --- `vllm serve` command lines (issue 22) ---------------------------------------------------


def test_vllm_serve_command_line_runs_unchanged() -> None:
    """MODEL positional, vLLM's spellings, and vLLM options engined does not model: ignored
    with one warning that names them, their values skipped (`-1` too), never read as MODEL."""
    result = invoke(
        "--print-config",
        "--gpu-memory-utilization",
        "0.9",
        "Qwen/Qwen3-0.6B",
        "--tensor-parallel-size=1",
        "--enforce-eager",
        "--max_model_len",
        "4096",
        "--served-model-name",
        "qwen",
        "--num-gpu-blocks-override",
        "512",
        "--ignore-patterns",
        "*.pt",
        "original/*",
        "--rank-processes",
        "-1",
        "--port",
        "8200",
    )
    assert result.exit_code == 0, result.output
    config = tomllib.loads(result.stdout)
    assert (config["model"], config["model_name"], config["api_port"]) == (
        "Qwen/Qwen3-0.6B",
        "qwen",
        8200,
    )
    assert (config["engine"]["max_model_len"], config["engine"]["num_gpu_blocks"]) == (4096, 512)
    assert config["rank_processes"] == -1
    assert result.stderr == (
        "engined serve: ignoring vLLM options engined does not model: "
        "--gpu-memory-utilization, --tensor-parallel-size, --enforce-eager, --ignore-patterns\n"
    )


def test_vllms_scheduler_options_reach_the_engine_and_the_rest_are_ignored() -> None:
    result = invoke(
        "--print-config",
        "--long-prefill-token-threshold",
        "64",
        "--long-prefill-token-threshold-adaptive",
        "--watermark",
        "0.05",
        "--max-num-active-seqs",
        "32",
        "--prefill-schedule-interval",
        "4",
        "--max-num-queued-reqs",
        "100",
        "--max-num-queued-tokens",
        "0",
        "--max-num-scheduled-tokens",
        "64",
        "--scheduler-cls",
        "my.Scheduler",
        "--stream-interval",
        "2",
    )
    assert result.exit_code == 0, result.output
    engine = tomllib.loads(result.stdout)["engine"]
    assert (
        engine["long_prefill_token_threshold"],
        engine["long_prefill_token_threshold_adaptive"],
        engine["watermark"],
        engine["max_num_active_seqs"],
        engine["prefill_schedule_interval"],
        engine["max_num_scheduled_tokens"],
    ) == (64, True, 0.05, 32, 4, 64)
    daemon = tomllib.loads(result.stdout)
    assert (
        daemon["stream_interval"],
        daemon["max_num_queued_reqs"],
        daemon["max_num_queued_tokens"],
    ) == (2, 100, 0)
    assert result.stderr == (
        "engined serve: ignoring vLLM options engined does not model: --scheduler-cls\n"
    )


def test_vllms_human_readable_counts_on_the_command_line() -> None:
    config = printed("--max-model-len", "32k", "--max-num-batched-tokens", "2K")
    assert (config["engine"]["max_model_len"], config["engine"]["max_num_batched_tokens"]) == (
        32_000,
        2048,
    )
    assert printed("--max-num-queued-tokens", "1.5k")["max_num_queued_tokens"] == 1500
    assert "max_model_len" not in printed("--max-model-len", "auto")["engine"]


def test_model_is_the_served_name_unless_one_is_given() -> None:
    assert printed("./models/tiny")["model_name"] == "./models/tiny"
    assert printed("--model", "./models/tiny")["model_name"] == "./models/tiny"
    assert printed()["model_name"] == "engined"


def test_model_given_twice_differently_is_refused() -> None:
    result = invoke("--print-config", "a", "--model", "b")
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == "error: model: given twice, as 'a' and as --model 'b'\n"


def test_unknown_option_is_still_refused() -> None:
    result = invoke("--print-config", "--gpu-memory-utilisation", "0.9")
    assert result.exit_code == CONFIG_ERROR
    assert "No such option: --gpu-memory-utilisation" in result.stderr


def test_kv_events_config_maps_onto_the_kv_events_keys() -> None:
    """llm-d's flag: a non-wildcard endpoint is connected to, as vLLM's publisher does."""
    llm_d = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://epp.llm-d.svc:5557", "topic": "kv@10.0.0.7@Qwen/Qwen3-0.6B", '
        '"buffer_steps": 500, "hwm": 1000}'
    )
    config = printed("--kv-events-config", llm_d)
    assert (
        config["kv_events_endpoint"],
        config["kv_events_connect"],
        config["kv_events_topic"],
        config["kv_replay_buffer"],
    ) == ("tcp://epp.llm-d.svc:5557", True, "kv@10.0.0.7@Qwen/Qwen3-0.6B", 500)
    bound = printed(
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", '
        '"replay_endpoint": "tcp://*:5601"}',
    )
    assert (
        bound["kv_events_endpoint"],
        bound["kv_events_connect"],
        bound["kv_replay_endpoint"],
        bound["kv_events_topic"],
    ) == ("tcp://*:5600", False, "tcp://*:5601", "")


def test_kv_events_config_enabled_without_endpoint_binds_vllms_default() -> None:
    config = printed("--kv-events-config", '{"enable_kv_cache_events": true}')
    assert (config["kv_events_endpoint"], config["kv_events_connect"]) == ("tcp://*:5557", False)


@pytest.mark.parametrize(
    "text",
    [
        '{"enable_kv_cache_events": false}',
        "{}",
        '{"enable_kv_cache_events": true, "publisher": "null"}',
        # vLLM's scheduler emits no events without enable_kv_cache_events, whatever publishes.
        '{"publisher": "zmq", "endpoint": "tcp://*:6000"}',
        '{"enable_kv_cache_events": false, "topic": "t", "replay_endpoint": "tcp://*:6001"}',
    ],
)
def test_kv_events_config_disabled_turns_kv_events_off(text: str) -> None:
    config = printed("--kv-events-config", text)
    assert (
        config["kv_events_endpoint"],
        config.get("kv_replay_endpoint"),
        config["kv_events_topic"],
    ) == ("", None, "")


def test_kv_events_config_disabled_refuses_a_replay_endpoint_by_both_names() -> None:
    result = invoke(
        "--print-config",
        "--kv-events-config",
        '{"enable_kv_cache_events": false}',
        "--kv-replay-endpoint",
        "tcp://*:6001",
    )
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == (
        'error: kv_replay_endpoint: replays KV events, but kv_events_endpoint = "" publishes '
        "none; unset one of them (from --kv-replay-endpoint)\n"
    )


def test_kv_events_config_disabled_and_an_endpoint_flag_conflict() -> None:
    result = invoke(
        "--print-config",
        "--kv-events-config",
        '{"enable_kv_cache_events": false}',
        "--kv-events-endpoint",
        "tcp://*:6000",
    )
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == (
        "error: --kv-events-config: also given by flag as kv_events_endpoint; set each once\n"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}',
            "error: --kv-events-config: Object contains unknown field `endpont`\n",
        ),
        (
            '{"enable_kv_cache_events": true, "buffer_steps": "many"}',
            "error: --kv-events-config: Expected `int`, got `str` - at `$.buffer_steps`\n",
        ),
        ("not json", "error: --kv-events-config: JSON is malformed: "),
        (
            '{"enable_kv_cache_events": true, "buffer_steps": 0}',
            "error: --kv-events-config: buffer_steps and max_queue_size must "
            "be >= 1 and hwm >= 0\n",
        ),
    ],
)
def test_bad_kv_events_config_is_refused_by_name(text: str, message: str) -> None:
    result = invoke("--print-config", "--kv-events-config", text)
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr.startswith(message)


def test_kv_events_config_and_its_own_flag_conflict() -> None:
    result = invoke(
        "--print-config",
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "topic": "a"}',
        "--kv-events-topic",
        "b",
    )
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == (
        "error: --kv-events-config: also given by flag as kv_events_topic; set each once\n"
    )


def test_api_server_and_curve_are_refused_together(tmp_path: Path) -> None:
    keys = tmp_path / "k"
    result = invoke(
        "--print-config",
        "--curve-secret-key-file",
        str(keys),
        "--curve-authorized-keys-file",
        str(keys),
    )
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr.startswith(
        "error: api_port: the OpenAI API servers cannot yet connect to a daemon under CURVE"
    )
    without_api = printed(
        "--port",
        "",
        "--curve-secret-key-file",
        str(keys),
        "--curve-authorized-keys-file",
        str(keys),
    )
    assert (without_api["curve_secret_key_file"], without_api["api_port"]) == (str(keys), "")


def test_served_model_name_takes_several_names_as_vllm() -> None:
    """vLLM's `nargs="+"`: every word up to the next option is a name, the first the one
    responses carry; MODEL then has to come before, as with vLLM."""
    config = printed("./m", "--served-model-name", "a", "b", "c", "--port", "9")
    assert (config["model"], config["model_name"], config["model_aliases"]) == (
        "./m",
        "a",
        ["b", "c"],
    )
    assert printed("--model-aliases", "x", "--model-aliases", "y,z")["model_aliases"] == [
        "x",
        "y,z",
    ]


def test_every_bad_setting_is_a_line_of_its_own() -> None:
    result = invoke(
        "--print-config", "--num-gpu-blocks", "0", "--block-size", "1", "--drain-timeout", "-1"
    )
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr.splitlines() == [
        "error: drain_timeout: Expected `float` >= 0.0, got -1.0 (from --drain-timeout)",
        "error: engine.num_gpu_blocks: num_gpu_blocks must be >= 1, got 0 (from --num-gpu-blocks)",
        "error: engine.block_size: the vLLM/TRT-LLM scheduler requires block_size to be at "
        "least 2 for engine_type=Vllm, got block_size=1 (from --block-size)",
    ]
    assert result.stdout == ""
