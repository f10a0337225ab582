"""The vocabulary facts of a local model directory, read once for every reader.

A client that detokenizes with the model (Dynamo's frontend, engined's own OpenAI API server)
turns an id outside the vocabulary into nothing, silently, and an EOS id ends the completion
early. So the daemon must draw ids in `[0, vocab_size)` and never draw the EOS or any other
special token. The directory says which those are: `config.json` (`vocab_size`,
`eos_token_id`, `max_position_embeddings`), `generation_config.json` (`eos_token_id`) and
`tokenizer.json` (its special added tokens). The Dynamo worker and the API server both read
them here, so both hand the daemon the same vocabulary for the same directory. Pure file
reading, no `engined` import: every layer above the core may use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelDirError(Exception):
    """The directory cannot be used; the message is one line naming the file and the field."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: Path
    vocab_size: int
    # None when config.json does not say.
    max_position_embeddings: int | None
    # config.json's, then generation_config.json's, in their order, without repeats.
    eos_token_ids: tuple[int, ...]
    # EOS ids and the other special tokens inside the vocabulary; sorted.
    excluded_token_ids: tuple[int, ...]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when the file does not exist."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = " ".join(str(exc).split())
        raise ModelDirError(f"{path}: cannot read it as JSON ({reason})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    return data


def token_ids(value: object, where: str) -> list[int]:
    """An `eos_token_id` value (one id, a list, or null) as a list."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ModelDirError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return list(items)


def read_model(path: Path, *, name: str, tokenizer_size: int | None = None) -> ModelInfo:
    """Read the vocabulary facts of a local model directory.

    `name` is how the user gave the directory (`--model-path DIR`), for the messages.
    `tokenizer_size`, when given, is the vocabulary size to use where config.json has no
    `vocab_size` (or no config.json exists): a tokenizer-only directory is enough then.

    Raises:
        ModelDirError: not a directory, no `vocab_size` (and no `tokenizer_size`), malformed
            JSON or fields.
    """
    if not path.is_dir():
        raise ModelDirError(f"{name}: not a directory (a local model directory is needed)")
    config_path = path / "config.json"
    config = read_json(config_path)
    if not config and tokenizer_size is None:
        raise ModelDirError(f"{name}: no config.json (it needs at least vocab_size)")
    vocab = config.get("vocab_size", tokenizer_size)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ModelDirError(f"{config_path}: vocab_size must be a positive int, got {vocab!r}")
    positions = config.get("max_position_embeddings")
    if positions is not None and (
        not isinstance(positions, int) or isinstance(positions, bool) or positions < 1
    ):
        raise ModelDirError(f"{config_path}: max_position_embeddings must be a positive int")
    eos = token_ids(config.get("eos_token_id"), f"{config_path}: eos_token_id")
    generation = path / "generation_config.json"
    eos += token_ids(read_json(generation).get("eos_token_id"), f"{generation}: eos_token_id")
    excluded = set(eos)
    tokenizer = read_json(path / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("special") and isinstance(token.get("id"), int):
            excluded.add(token["id"])
    in_vocab = sorted(i for i in excluded if i < vocab)
    if len(in_vocab) >= vocab:
        raise ModelDirError(f"{path}: every id of the vocabulary is a special token")
    return ModelInfo(
        path=path,
        vocab_size=vocab,
        max_position_embeddings=positions,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        excluded_token_ids=tuple(in_vocab),
    )
