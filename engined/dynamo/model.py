"""What the worker needs from a model directory, and how it reconciles it with the daemon.

Dynamo's frontend tokenizes with the model directory and detokenizes the worker's ids with
it, so the daemon must draw what the directory allows: engined/model_dir.py reads that (the
API server reads it there too). Everything here is pure, so it is tested without Dynamo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engined.model_dir import ModelDirError, ModelInfo
from engined.model_dir import read_model as read_model_dir
from engined.wire.control import Welcome


class SetupError(Exception):
    """The worker cannot start; the message says why and what to do (no traceback)."""


def read_model(path: Path) -> ModelInfo:
    """Read the vocabulary facts of `--model-path`.

    Raises:
        SetupError: not a directory, no `config.json` with `vocab_size`, malformed JSON.
    """
    try:
        return read_model_dir(path, name=f"--model-path {path}")
    except ModelDirError as exc:
        raise SetupError(str(exc)) from None


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
        'or without --vocab-size (and with --port "": a daemon serving its own OpenAI API '
        "draws from its own model's vocabulary) so that the worker sets it"
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
