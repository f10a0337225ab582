"""What the worker needs from a model directory, and how it reconciles it with the daemon.

Dynamo's frontend tokenizes with the model directory and detokenizes the worker's ids with
it: an id outside the vocabulary decodes to nothing (silently), and an EOS id ends the
completion early. So the daemon must draw ids in `[0, vocab_size)` and never draw the EOS or
any other special token. The directory says which those are: `config.json` (`vocab_size`,
`eos_token_id`, `max_position_embeddings`), `generation_config.json` (`eos_token_id`) and
`tokenizer.json` (its special added tokens). Everything here is pure, so it is tested
without Dynamo.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engined.wire.control import Welcome


class SetupError(Exception):
    """The worker cannot start; the message says why and what to do (no traceback)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: Path
    vocab_size: int
    # None when config.json does not say.
    max_position_embeddings: int | None
    # EOS ids first (config, then generation config), then the other special tokens; sorted.
    excluded_token_ids: tuple[int, ...]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SetupError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SetupError(f"{path}: expected a JSON object")
    return data


def _ids(value: object, where: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise SetupError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return list(items)


def read_model(path: Path) -> ModelInfo:
    """Read the vocabulary facts of a local model directory.

    Raises:
        SetupError: not a directory, no `config.json` with `vocab_size`, malformed JSON.
    """
    if not path.is_dir():
        raise SetupError(
            f"--model-path {path}: not a directory (a local model directory is needed)"
        )
    config_path = path / "config.json"
    config = _read_json(config_path)
    if not config:
        raise SetupError(f"--model-path {path}: no config.json (it needs at least vocab_size)")
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise SetupError(f"{config_path}: vocab_size must be a positive int, got {vocab!r}")
    positions = config.get("max_position_embeddings")
    if positions is not None and (not isinstance(positions, int) or positions < 1):
        raise SetupError(f"{config_path}: max_position_embeddings must be a positive int")
    excluded = set(_ids(config.get("eos_token_id"), f"{config_path}: eos_token_id"))
    generation = path / "generation_config.json"
    excluded.update(_ids(_read_json(generation).get("eos_token_id"), f"{generation}: eos_token_id"))
    tokenizer = _read_json(path / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("special") and isinstance(token.get("id"), int):
            excluded.add(token["id"])
    in_vocab = sorted(i for i in excluded if i < vocab)
    if len(in_vocab) >= vocab:
        raise SetupError(f"{path}: every id of the vocabulary is a special token")
    return ModelInfo(
        path=path,
        vocab_size=vocab,
        max_position_embeddings=positions,
        excluded_token_ids=tuple(in_vocab),
    )


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What the daemon must draw from; `apply` False when it already does."""

    vocab_size: int
    excluded_token_ids: tuple[int, ...]
    apply: bool


def reconcile_vocabulary(model: ModelInfo, welcome: Welcome) -> Vocabulary:
    """The vocabulary the daemon must use, or SetupError when its own contradicts the model.

    A daemon started without `--vocab-size` draws random u32 ids, which the frontend cannot
    decode: the worker then sets the model's vocabulary on it. A daemon started with one keeps
    it, but only if the model can decode it and no EOS of the model can come out.
    """
    wanted = Vocabulary(model.vocab_size, model.excluded_token_ids, apply=True)
    if welcome.vocab_size is None:
        return wanted
    hint = (
        f"start the daemon with --vocab-size {model.vocab_size} "
        f"--excluded-token-ids '{excluded_text(model.excluded_token_ids)}', "
        "or without --vocab-size so that the worker sets it"
    )
    if welcome.vocab_size > model.vocab_size:
        raise SetupError(
            f"the daemon draws token ids from [0, {welcome.vocab_size}) but the model's "
            f"vocab_size is {model.vocab_size}: the frontend would decode ids past it to "
            f"nothing; {hint}"
        )
    daemon_excluded = set(welcome.excluded_token_ids or ())
    missing = [
        i for i in model.excluded_token_ids if i < welcome.vocab_size and i not in daemon_excluded
    ]
    if missing:
        raise SetupError(
            f"the daemon may generate the model's special token ids {missing} (EOS would end "
            f"completions early); {hint}"
        )
    return Vocabulary(welcome.vocab_size, tuple(sorted(daemon_excluded)), apply=False)


def context_length(model: ModelInfo, daemon_context: int) -> int:
    """The longest prompt + output to advertise: the daemon's (its `welcome.max_model_len`,
    already capped by its KV pool), within the model's positions."""
    if model.max_position_embeddings is None:
        return daemon_context
    return min(daemon_context, model.max_position_embeddings)


def check_role(mode: str, welcome: Welcome) -> None:
    """A prefill worker needs a prefill daemon, a decode worker a decode daemon."""
    expected = {"agg": "aggregated", "prefill": "prefill", "decode": "decode"}[mode]
    if welcome.worker_type != expected:
        raise SetupError(
            f"--disaggregation-mode {mode} needs a daemon started with --worker-type "
            f"{expected}, but the daemon at this endpoint is {str(welcome.worker_type)!r}"
        )


def excluded_text(ids: Sequence[int]) -> str:
    return ",".join(str(i) for i in ids)
