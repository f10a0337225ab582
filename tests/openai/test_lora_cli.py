"""`engined serve --lora-modules` as `vllm serve` reads it: several values after the flag,
the last occurrence winning, and vLLM's words for a value it cannot read (exit 2)."""

from __future__ import annotations

import os
import tomllib
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from engined.cli import CONFIG_ERROR, app
from engined.config import ENV_PREFIX


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
