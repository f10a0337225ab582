"""The worker's reading of a model directory and its reconciliation with the daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engined.dynamo.model import (
    SetupError,
    check_role,
    context_length,
    read_model,
    reconcile_vocabulary,
)
from engined.dynamo.worker import publishes_kv_events
from engined.dynamo.worker_args import DisaggregationMode, parse_args
from engined.wire.control import Welcome


def model_dir(tmp_path: Path, config: dict[str, Any] | None = None, **files: Any) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    base = {"vocab_size": 1000, "max_position_embeddings": 4096, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(base if config is None else config))
    for name, content in files.items():
        (path / f"{name}.json").write_text(
            content if isinstance(content, str) else json.dumps(content)
        )
    return path


def welcome(**overrides: Any) -> Welcome:
    fields: dict[str, Any] = {
        "protocol": 1,
        "version": "0.1.0",
        "engine_type": "vllm",
        "worker_type": "aggregated",
        "block_size": 16,
        "num_gpu_blocks": 1024,
        "dp_size": 1,
        "model_name": "engined",
        "kv_events_endpoints": ["tcp://127.0.0.1:5557"],
        "kv_replay_endpoints": [],
        "fpm_endpoints": [],
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_model_len": 16384,
        "excluded_token_ids": [],
    }
    fields.update(overrides)
    return Welcome(**fields)


def test_special_tokens_come_from_config_generation_config_and_tokenizer(tmp_path: Path) -> None:
    tokenizer = {
        "added_tokens": [
            {"id": 0, "content": "<unk>", "special": True},
            {"id": 7, "content": "<tool>", "special": False},
            {"id": 999, "content": "<pad>", "special": True},
            {"id": 5000, "content": "<out-of-vocab>", "special": True},
        ]
    }
    path = model_dir(tmp_path, generation_config={"eos_token_id": [2, 3]}, tokenizer=tokenizer)
    info = read_model(path)
    assert info.vocab_size == 1000
    assert info.max_position_embeddings == 4096
    assert info.excluded_token_ids == (0, 2, 3, 999)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param({}, "no config.json", id="empty-config"),
        pytest.param({"vocab_size": 0}, "vocab_size must be a positive int, got 0", id="vocab-0"),
        pytest.param({"vocab_size": "1000"}, "vocab_size must be a positive int", id="vocab-str"),
        pytest.param({"vocab_size": 10, "eos_token_id": "x"}, "eos_token_id", id="eos-str"),
        pytest.param({"vocab_size": 1, "eos_token_id": 0}, "every id", id="all-special"),
        pytest.param(
            {"vocab_size": 10, "max_position_embeddings": -1}, "max_position_embeddings", id="pos"
        ),
    ],
)
def test_bad_model_directories_are_named(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(SetupError, match=message):
        read_model(model_dir(tmp_path, config))


def test_missing_and_unreadable_directories(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="not a directory"):
        read_model(tmp_path / "nowhere")
    path = model_dir(tmp_path, generation_config="{not json")
    with pytest.raises(SetupError, match=r"generation_config\.json: cannot read it as JSON"):
        read_model(path)


def test_a_daemon_without_a_vocabulary_gets_the_models(tmp_path: Path) -> None:
    info = read_model(model_dir(tmp_path))
    vocab = reconcile_vocabulary(info, welcome(vocab_size=None))
    assert (vocab.vocab_size, vocab.excluded_token_ids, vocab.apply) == (1000, (2,), True)


def test_a_compatible_daemon_vocabulary_is_kept(tmp_path: Path) -> None:
    info = read_model(model_dir(tmp_path))
    vocab = reconcile_vocabulary(info, welcome(vocab_size=500, excluded_token_ids=[2, 9]))
    assert (vocab.vocab_size, vocab.excluded_token_ids, vocab.apply) == (500, (2, 9), False)


@pytest.mark.parametrize(
    ("vocab_size", "excluded", "message"),
    [
        pytest.param(32000, [2], r"\[0, 32000\) but the model's vocab_size is 1000", id="wider"),
        pytest.param(1000, [], r"special token ids \[2\]", id="eos-drawable"),
    ],
)
def test_a_contradicting_daemon_vocabulary_stops_the_worker(
    tmp_path: Path, vocab_size: int, excluded: list[int], message: str
) -> None:
    info = read_model(model_dir(tmp_path))
    with pytest.raises(SetupError, match=message) as refused:
        reconcile_vocabulary(info, welcome(vocab_size=vocab_size, excluded_token_ids=excluded))
    assert "--vocab-size 1000 --excluded-token-ids '2'" in str(refused.value)


def test_context_length_is_the_daemons_within_the_models_positions(tmp_path: Path) -> None:
    info = read_model(model_dir(tmp_path))
    assert context_length(info, 16384) == 4096
    assert context_length(info, 1024) == 1024


def test_roles_must_match(tmp_path: Path) -> None:
    check_role("prefill", welcome(worker_type="prefill"))
    with pytest.raises(SetupError, match="needs a daemon started with --worker-type decode"):
        check_role("decode", welcome(worker_type="aggregated"))


def test_worker_flags_follow_dynamos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_NAMESPACE", raising=False)
    monkeypatch.delenv("DYN_DISCOVERY_BACKEND", raising=False)
    monkeypatch.setenv("ENGINED_CONTROL_ENDPOINT", "tcp://127.0.0.1:6000")
    args = parse_args(["--model-path", "m"])
    assert args.endpoint_path == "dynamo.backend.generate"
    assert (args.discovery_backend, args.request_plane) == ("etcd", "tcp")
    assert args.control_endpoint == "tcp://127.0.0.1:6000"
    prefill = parse_args(["--model-path", "m", "--disaggregation-mode", "prefill"])
    assert prefill.disaggregation_mode is DisaggregationMode.PREFILL
    assert prefill.endpoint_path == "dynamo.prefill.generate"
    full = parse_args(["--model-path", "m", "--endpoint", "dyn://ns.comp.gen"])
    assert full.endpoint_path == "ns.comp.gen"
    assert args.worker_per_rank is False
    assert parse_args(["--model-path", "m", "--worker-per-rank"]).worker_per_rank is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "--model-path", id="no-model"),
        pytest.param(["--model-path", "m", "--disaggregation-mode", "both"], "invalid", id="mode"),
        pytest.param(
            ["--model-path", "m", "--control-endpoint", "http://x"], "control-endpoint", id="ep"
        ),
        pytest.param(["--model-path", "m", "--endpoint", "dyn://a.b"], "--endpoint", id="path"),
        pytest.param(["--model-path", "m", "--connect-timeout", "0"], "must be > 0", id="timeout"),
    ],
)
def test_bad_worker_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prefix_caching", "endpoints", "expected"),
    [
        (True, ["tcp://127.0.0.1:5557"], True),
        (True, [], False),  # kv_events_endpoint = "": registered without events
        (False, ["tcp://127.0.0.1:5557"], False),
        (None, ["tcp://127.0.0.1:5557"], False),
    ],
)
def test_a_daemon_without_kv_events_is_registered_without_them(
    prefix_caching: bool | None, endpoints: list[str], expected: bool
) -> None:
    daemon = welcome(enable_prefix_caching=prefix_caching, kv_events_endpoints=endpoints)
    assert publishes_kv_events(daemon) is expected
