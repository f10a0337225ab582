"""The command-line conventions people expect (issue 11): `python -m engined`, `--version`,
one name for the rank option (`--dp-rank`, with `--rank` kept as an alias where it was the
name), and a `serve --help` that is readable at 80 columns and shows the defaults.

No daemon runs here: the rank tests replace the tool a command runs with a recorder, so they
check what the option parsed to, not what a daemon answered.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import engined
import engined.core
from engined.cli import app
from engined.core import COMPILED_MODULES, core_build
from engined.tools import events as events_tool
from engined.tools import fpm_watch as fpm_tool

RUN_TIMEOUT_S = 60.0
ROOT = Path(engined.__file__).resolve().parents[1]


def run_module(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "engined", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        check=False,
    )


# --- python -m engined, --version --------------------------------------------------------------


def test_python_dash_m_engined_prints_the_version() -> None:
    result = run_module("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"engined {engined.__version__}"


def test_version_names_the_core_on_stderr() -> None:
    """Which core runs, and why the pure one: stderr, so stdout stays the bare version."""
    result = run_module("--version")
    assert result.stderr.splitlines() == [f"core: {engined.core.build()}"]
    environ = {**os.environ, "ENGINED_PURE": "1"}
    pure = subprocess.run(
        [sys.executable, "-m", "engined", "--version"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=environ,
        check=True,
    )
    expected = core_build.inspect(ROOT, COMPILED_MODULES, environ)
    assert not expected.compiled
    assert pure.stderr.splitlines() == [f"core: {expected}"]


def test_python_dash_m_engined_is_the_cli() -> None:
    result = run_module("--help", columns=80)
    assert result.returncode == 0, result.stderr
    # The program names itself `engined`, not `__main__.py`, and lists its commands.
    assert "Usage: engined" in result.stdout
    for command in ("serve", "submit", "events", "fpm", "stats", "bench", "dynamo-worker"):
        assert command in result.stdout


def test_version_option_in_process() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert engined.__version__ in result.output


# --- one name for the rank option -------------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Options the `events` and `fpm` commands would run their tool with (the tool never runs)."""
    seen: list[Any] = []

    async def record(options: Any, out: Any) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr(events_tool, "events", record)
    monkeypatch.setattr(fpm_tool, "fpm", record)
    return seen


@pytest.mark.parametrize("command", ["events", "fpm"])
@pytest.mark.parametrize("spelling", ["--dp-rank", "--rank"])
def test_rank_option_and_its_alias(recorded: list[Any], command: str, spelling: str) -> None:
    result = CliRunner().invoke(app, [command, spelling, "1", "--json"])
    assert result.exit_code == 0, result.output
    assert [options.rank for options in recorded] == [1]


@pytest.mark.parametrize("command", ["events", "fpm"])
def test_rank_defaults_to_zero(recorded: list[Any], command: str) -> None:
    result = CliRunner().invoke(app, [command, "--json"])
    assert result.exit_code == 0, result.output
    assert [options.rank for options in recorded] == [0]


@pytest.mark.parametrize("spelling", ["--dp-rank", "--rank"])
def test_rank_option_is_checked_under_either_name(recorded: list[Any], spelling: str) -> None:
    result = CliRunner().invoke(app, ["events", spelling, "-1"])
    assert result.exit_code == 2
    assert recorded == []


@pytest.mark.parametrize("command", ["submit", "bench", "events", "fpm"])
def test_every_command_documents_dp_rank(command: str) -> None:
    result = run_module(command, "--help", columns=200)
    assert result.returncode == 0, result.stderr
    assert "--dp-rank" in result.stdout
    # `--rank` stays only where it was the name, and only as the second spelling.
    if command in ("events", "fpm"):
        assert re.search(r"--dp-rank\s*,\s*--rank", result.stdout), result.stdout


# --- serve --help at 80 columns ----------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_help() -> str:
    result = run_module("serve", "--help", columns=80)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_serve_help_fits_80_columns(serve_help: str) -> None:
    # Except an option's names alone on their line, which cannot wrap: vLLM's switch
    # `--long-prefill-token-threshold-adaptive / --no-...` is longer than 80 columns (its help
    # then starts on the next line, within them).
    too_long = [
        line
        for line in serve_help.splitlines()
        if len(line) > 80 and not re.fullmatch(r"  --[a-z0-9-]+ / --no-[a-z0-9-]+", line)
    ]
    assert too_long == []


def test_serve_help_names_every_option_in_full(serve_help: str) -> None:
    # Rich's table truncated long names at 80 columns (`--enable-prefix-…`).
    assert "…" not in serve_help
    for name in (
        "--enable-prefix-caching / --no-enable-prefix-caching",
        "--kv-transfer-timing-mode",
        "--max-num-batched-tokens",
        "--kv-replay-client-bytes",
        "--bandwidth-g2-to-g3-gbps",
    ):
        assert name in serve_help


def test_serve_help_shows_defaults(serve_help: str) -> None:
    text = " ".join(serve_help.split())  # help lines wrap anywhere
    for option, default in (
        ("--num-gpu-blocks, --num-gpu-blocks-override INT", "16384"),
        ("--block-size INT", "64"),
        ("--speedup-ratio FLOAT", "1.0"),
        ("--preemption-mode [lifo|fifo]", "lifo"),
        ("--control-endpoint ENDPOINT", "tcp://127.0.0.1:5555"),
        ("--kv-replay-endpoint ENDPOINT", '""'),
        ("--enable-prefix-caching / --no-enable-prefix-caching", "enable-prefix-caching"),
    ):
        match = re.search(re.escape(option) + r" .*?\[default: ([^\]]*)\]", text)
        assert match is not None, option
        assert match.group(1) == default, option


def test_serve_help_groups_options_by_section(serve_help: str) -> None:
    assert "Engine options:" in serve_help
    assert "Daemon options:" in serve_help
    assert serve_help.index("--num-gpu-blocks") < serve_help.index("Daemon options:")
    assert serve_help.index("Daemon options:") < serve_help.index("--drain-timeout")
