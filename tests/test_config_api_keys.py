"""The HTTP API keys: `api_key` in every layer, VLLM_API_KEY, `api_key_file`, refusals.

A refused key or key file is a bad setting: exit 2 before anything starts, with a message that
names the key by position or the file by path and line, and never quotes a key.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from engined.cli import CONFIG_ERROR, app
from engined.config import ENV_PREFIX, ConfigError, DaemonConfig, dump_config, load_config
from engined.config.api_keys import MAX_KEY_CHARS, MAX_KEY_FILE_BYTES
from tests.test_config import load

SECRET = "sk-secret-7f3a"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) or name == "VLLM_API_KEY":
            monkeypatch.delenv(name)


def refused(message: str, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$") as caught:
        load(**kwargs)
    assert SECRET not in str(caught.value)
    return caught.value


def key_file(tmp_path: Path, content: str | bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "api_key"
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    path.chmod(mode)
    return path


# --- the layers -------------------------------------------------------------------------------


def test_no_key_by_default() -> None:
    config = load()
    assert (config.api_key, config.api_key_file, config.api_key_metrics) == (None, None, False)
    assert config == DaemonConfig()


def test_toml_takes_one_key_or_a_list(tmp_path: Path) -> None:
    assert load(f'api_key = "{SECRET}"\n', tmp_path=tmp_path).api_key == (SECRET,)
    assert load('api_key = ["a", "b"]\n', tmp_path=tmp_path).api_key == ("a", "b")
    assert load('api_key = ""\n', tmp_path=tmp_path).api_key is None


def test_text_forms_are_one_key_verbatim() -> None:
    """No separator is reserved: a comma or an inner space is part of the key, as in vLLM."""
    assert load(flags={"api_key": "a,b c"}).api_key == ("a,b c",)
    assert load(env={"ENGINED_API_KEY": "a,b c"}).api_key == ("a,b c",)
    assert load(env={"VLLM_API_KEY": "a,b c"}).api_key == ("a,b c",)


def test_flag_beats_environment_beats_toml(tmp_path: Path) -> None:
    toml = 'api_key = ["t1", "t2"]\n'
    assert load(toml, env={"ENGINED_API_KEY": "e"}, tmp_path=tmp_path).api_key == ("e",)
    config = load(toml, env={"ENGINED_API_KEY": "e"}, flags={"api_key": "f"}, tmp_path=tmp_path)
    assert config.api_key == ("f",)


def test_vllm_api_key_counts_only_without_another_key(tmp_path: Path) -> None:
    vllm = {"VLLM_API_KEY": "v"}
    assert load(env=vllm).api_key == ("v",)
    assert load(env={**vllm, "ENGINED_API_KEY": "e"}).api_key == ("e",)
    assert load(env=vllm, flags={"api_key": "f"}).api_key == ("f",)
    assert load('api_key = "t"\n', env=vllm, tmp_path=tmp_path).api_key == ("t",)
    # An unset key (the example config's `api_key = ""`) leaves the fallback in force.
    assert load('api_key = ""\n', env=vllm, tmp_path=tmp_path).api_key == ("v",)
    assert load(env={"VLLM_API_KEY": ""}).api_key is None
    path = key_file(tmp_path, "from-file\n")
    assert load(env=vllm, flags={"api_key_file": str(path)}).api_key == ("from-file",)


# --- keys no request could carry -------------------------------------------------------------

_HEADER = "has a character a request header cannot carry (printable ASCII only)"
_ENDS = "starts or ends with a space, which request headers lose"


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "is empty"),
        (f" {SECRET}", _ENDS),
        (f"{SECRET} ", _ENDS),
        (f"{SECRET}é", _HEADER),
        (f"{SECRET}\t", _HEADER),
        (f"{SECRET}\r\nX: y", _HEADER),
        (f"{SECRET}\x00", _HEADER),
        (SECRET * 300, f"is {len(SECRET) * 300} characters long, more than {MAX_KEY_CHARS}"),
    ],
)
def test_a_key_no_request_could_carry_is_refused(key: str, problem: str) -> None:
    refused(f"api_key: key 2 of 2 {problem} (from --api-key)", flags={"api_key": ["ok", key]})


def test_key_limits_are_inclusive() -> None:
    assert load(flags={"api_key": "k" * MAX_KEY_CHARS}).api_key == ("k" * MAX_KEY_CHARS,)
    assert load(flags={"api_key": "a b"}).api_key == ("a b",)
    assert load(flags={"api_key": "!~"}).api_key == ("!~",)


def test_refusals_name_the_layer(tmp_path: Path) -> None:
    refused(f"api_key: key 1 of 1 {_ENDS} (from VLLM_API_KEY)", env={"VLLM_API_KEY": f"{SECRET} "})
    refused(f"api_key: key 1 of 1 {_ENDS} (from ENGINED_API_KEY)", env={"ENGINED_API_KEY": " x"})
    toml = tmp_path / "engined.toml"
    refused(
        f"api_key: key 2 of 3 is empty (from {toml})",
        toml=f'api_key = ["{SECRET}", "", "b"]\n',
        tmp_path=tmp_path,
    )
    refused(
        f"api_key: Expected `str`, got `int` - at `$[1]` (from {toml})",
        toml='api_key = ["a", 5]\n',
        tmp_path=tmp_path,
    )
    refused(
        f"api_key: Expected `array | null`, got `int` (from {toml})",
        toml="api_key = 5\n",
        tmp_path=tmp_path,
    )


def test_api_key_metrics_needs_a_key() -> None:
    refused(
        "api_key_metrics: needs a key to require: api_key, api_key_file or VLLM_API_KEY "
        "(from --api-key-metrics)",
        flags={"api_key_metrics": True},
    )
    config = load(env={"VLLM_API_KEY": "v"}, flags={"api_key_metrics": True})
    assert (config.api_key, config.api_key_metrics) == (("v",), True)


# --- the key file -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o400, 0o660])
def test_key_file_keys_one_per_line(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, f"\n  {SECRET}  \r\nsecond key\n\n\tthird\n", mode)
    config = load(flags={"api_key_file": str(path)})
    assert (config.api_key, config.api_key_file) == ((SECRET, "second key", "third"), str(path))


def test_key_file_from_each_layer(tmp_path: Path) -> None:
    path = key_file(tmp_path, "k\n")
    assert load(env={"ENGINED_API_KEY_FILE": str(path)}).api_key == ("k",)
    assert load(f'api_key_file = "{path}"\n', tmp_path=tmp_path).api_key == ("k",)


@pytest.mark.parametrize(
    ("mode", "what"),
    [(0o644, "read"), (0o604, "read"), (0o602, "written"), (0o666, "read and written")],
)
def test_key_file_others_may_use_is_refused(tmp_path: Path, mode: int, what: str) -> None:
    path = key_file(tmp_path, f"{SECRET}\n", mode)
    refused(
        f"api_key_file: {path} can be {what} by every user (mode {mode:04o}); "
        "make it 0600 or 0640 (from --api-key-file)",
        flags={"api_key_file": str(path)},
    )


def test_key_file_that_is_not_a_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO with no writer and an endless device would stall or flood start-up."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for path in (fifo, tmp_path, Path("/dev/zero")):
        refused(
            f"api_key_file: {path} is not a regular file (from --api-key-file)",
            flags={"api_key_file": str(path)},
        )
    missing = tmp_path / "missing"
    refused(
        f"api_key_file: {missing}: No such file or directory (from --api-key-file)",
        flags={"api_key_file": str(missing)},
    )


def test_key_file_content_refusals(tmp_path: Path) -> None:
    cases: list[tuple[str | bytes, str]] = [
        ("", "holds no key"),
        ("\n \n\t\n", "holds no key"),
        (b"\xff\xfe" + SECRET.encode(), "is not UTF-8 text"),
        (f"ok\n{SECRET}é\n", f"line 2: the key {_HEADER}"),
        (f"ok\n\n{SECRET * 300}\n", f"line 3: the key is {len(SECRET) * 300} characters"),
        ("k" * (MAX_KEY_FILE_BYTES + 1), f"is larger than {MAX_KEY_FILE_BYTES} bytes"),
    ]
    for content, problem in cases:
        path = key_file(tmp_path, content)
        with pytest.raises(ConfigError) as caught:
            load(flags={"api_key_file": str(path)})
        message = str(caught.value)
        assert message.startswith(f"api_key_file: {path} {problem}")
        assert message.endswith("(from --api-key-file)")
        assert SECRET not in message


def test_key_file_at_its_size_limit_is_read(tmp_path: Path) -> None:
    keys = ["k" * MAX_KEY_CHARS] * (MAX_KEY_FILE_BYTES // (MAX_KEY_CHARS + 1))
    content = "\n".join(keys)
    content += "\n" * (MAX_KEY_FILE_BYTES - len(content))
    assert len(content) == MAX_KEY_FILE_BYTES
    config = load(flags={"api_key_file": str(key_file(tmp_path, content))})
    assert config.api_key == tuple(keys)


def test_key_and_key_file_together_are_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path, "k\n")
    refused(
        "api_key_file: cannot be set with api_key (from ENGINED_API_KEY); give the keys one way "
        "(from --api-key-file)",
        env={"ENGINED_API_KEY": SECRET},
        flags={"api_key_file": str(path)},
    )


# --- printing and the command line ------------------------------------------------------------


def test_print_config_leaves_file_keys_in_their_file(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{SECRET}\n")
    config = load(flags={"api_key_file": str(path), "api_key_metrics": True})
    text = dump_config(config)
    assert SECRET not in text
    assert tomllib.loads(text)["api_key_file"] == str(path)
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    assert load_config(config_path=printed, env={}, flags={}) == config


def test_print_config_round_trips_inline_keys(tmp_path: Path) -> None:
    config = load(flags={"api_key": ["a", 'q"uote\\']})
    printed = tmp_path / "printed.toml"
    printed.write_text(dump_config(config))
    assert tomllib.loads(printed.read_text())["api_key"] == ["a", 'q"uote\\']
    assert load_config(config_path=printed, env={}, flags={}) == config


def test_cli_refuses_a_world_readable_key_file_with_exit_2(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{SECRET}\n", 0o644)
    result = CliRunner().invoke(app, ["serve", "--api-key-file", str(path)])
    assert result.exit_code == CONFIG_ERROR
    assert result.stderr == (
        f"error: api_key_file: {path} can be read by every user (mode 0644); make it 0600 or "
        "0640 (from --api-key-file)\n"
    )


def test_cli_api_key_takes_one_key() -> None:
    """`--api-key` takes one key (several go in TOML or the file): in vLLM's `--api-key K1 K2`
    the second word is the positional MODEL, and a third is a usage error."""
    ok = CliRunner().invoke(app, ["serve", "--print-config", "--api-key", SECRET])
    assert (ok.exit_code, tomllib.loads(ok.stdout)["api_key"]) == (0, [SECRET])
    two = CliRunner().invoke(app, ["serve", "--print-config", "--api-key", "k1", "k2"])
    assert two.exit_code == 0
    assert (tomllib.loads(two.stdout)["api_key"], tomllib.loads(two.stdout)["model"]) == (
        ["k1"],
        "k2",
    )
    three = CliRunner().invoke(app, ["serve", "--print-config", "--api-key", "k1", "k2", "k3"])
    assert three.exit_code == CONFIG_ERROR
    assert "Got unexpected extra argument(s) (k3)" in three.stderr
