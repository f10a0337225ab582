"""`engined serve --lora-modules` as `vllm serve` reads it: several values after the flag,
the last occurrence winning, vLLM's words for a value it cannot read (exit 2), and what vLLM
refuses as its API servers start, refused before the daemon starts (exit 2)."""

from __future__ import annotations

import os
import tomllib
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from engined.cli import CONFIG_ERROR, app
from engined.config import ENV_PREFIX
from tests.test_cli_serve import fake_daemon


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests own every ENGINED_* variable and vLLM's runtime-loading switch."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) or name == "VLLM_ALLOW_RUNTIME_LORA_UPDATING":
            monkeypatch.delenv(name)


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, ["serve", *args], env=env)


def printed(*args: str) -> dict[str, Any]:
    result = invoke("--print-config", *args)
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.stdout)


def test_several_values_follow_the_flag_as_in_vllm() -> None:
    """vLLM's `nargs="+"`: every word up to the next option; JSON values whole."""
    config = printed(
        "./m",
        "--lora-modules",
        "a=/x",
        '{"name": "b", "path": "/y", "base_model_name": "./m"}',
        "--port",
        "9",
    )
    assert config["lora_modules"] == [
        "a=/x",
        '{"name": "b", "path": "/y", "base_model_name": "./m"}',
    ]
    assert (config["model"], config["api_port"]) == ("./m", 9)


def test_the_last_occurrence_wins_as_in_vllm() -> None:
    """vLLM's action replaces the list each time the flag is given (it warns of the
    duplicate); `--lora-modules=VALUE` is one value, and so is a value starting with `-`
    only after `=`."""
    assert printed("--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z")["lora_modules"] == [
        "c=/z"
    ]
    assert printed("--lora-modules", "a=/x", "--lora-modules=-d=/w")["lora_modules"] == ["-d=/w"]
    assert printed("--lora-modules=a=/x", "--", "./m")["lora_modules"] == ["a=/x"]


def test_a_flag_without_a_value_is_refused() -> None:
    for args in (("--lora-modules",), ("--lora-modules", "--port", "9")):
        result = invoke("--print-config", *args)
        assert result.exit_code == CONFIG_ERROR
        assert "Option '--lora-modules' requires an argument." in result.output


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("notjson", "Invalid JSON format for --lora-modules: notjson"),
        (
            "{}",
            "Invalid fields for --lora-modules: {} - LoRAModulePath.__init__() missing 2 "
            "required positional arguments: 'name' and 'path'",
        ),
        (
            '{"name": "a", "path": "/p", "rank": 8}',
            'Invalid fields for --lora-modules: {"name": "a", "path": "/p", "rank": 8} - '
            "LoRAModulePath.__init__() got an unexpected keyword argument 'rank'",
        ),
    ],
)
def test_vllms_parse_errors_exit_2_naming_the_key(value: str, message: str) -> None:
    """vLLM's parser.error text, on a line of its own, whatever values come before."""
    result = invoke("--print-config", "--lora-modules", "ok=/fine", value, "--port", "9")
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == f"error: lora_modules: {message} (from --lora-modules)\n"
    assert result.stdout == ""


# --- what vLLM refuses as its API servers start -------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--lora-modules", "a=/x"),
            "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable "
            "LoRA.",
        ),
        (
            ("--enable-lora", "--lora-modules", "a=/x", "b=/y", "a=/z"),
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
        ),
        (
            ("--enable-lora", "--served-model-name", "base", "alias", "--lora-modules", "alias=/x"),
            "The lora adapter 'alias' conflicts with a served base model.",
        ),
        (
            ("--enable-lora", "--lora-modules", "a="),
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            ("--enable-lora", "--lora-modules", '{"name": "", "path": "/x"}'),
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        # engined's own: the control protocol carries a name of at most 256 bytes.
        (
            ("--enable-lora", "--lora-modules", "n" * 257 + "=/x"),
            "'lora_name' is 257 bytes of UTF-8: engined serves adapters whose lora_name is at "
            "most 256 bytes.",
        ),
    ],
)
def test_adapters_vllm_would_not_load_stop_serve(args: tuple[str, ...], message: str) -> None:
    """vLLM loads its static adapters as its API server starts and stops on the first it
    cannot load; `engined serve` refuses them before the daemon starts."""
    result = invoke(*args, "--port", "9")
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == f"error: lora_modules: vLLM's API server would not start: {message}\n"


@pytest.mark.parametrize("value", ["1", "true", " TRUE "])
def test_runtime_loading_with_several_api_servers_is_refused(value: str) -> None:
    """vLLM's `run_multi_api_server` refuses it: each process would keep its own adapters."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    result = invoke("--api-server-count", "2", "--port", "9", env=env)
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == (
        "error: api_server_count: VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with "
        "api_server_count > 1, as in vLLM (each process would load its own adapters), got 2\n"
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        # vLLM reads only 1 and true as on.
        (("--api-server-count", "2", "--port", "9"), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}),
        # No API server, nothing to load at run time.
        (("--api-server-count", "2", "--port", ""), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}),
        (("--api-server-count", "1", "--port", "9"), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}),
        (("--enable-lora", "--lora-modules", "a=/x", "b=/x", "--port", "9"), {}),
    ],
)
def test_what_vllm_starts_with_reaches_the_daemon(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], env: dict[str, str]
) -> None:
    seen = fake_daemon(monkeypatch, 0)
    result = invoke(*args, env=env)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
