"""Where a tokenizer comes from: a local directory, the Hugging Face cache, or the embedded one.

engined has no network: a hub name is found only where `vllm serve` with `HF_HUB_OFFLINE=1`
finds it, in the local Hugging Face cache (`models--ORG--NAME/snapshots/<rev>/`, the revision
that `refs/main` names). A name found nowhere is an error rather than a quiet fallback to
the embedded tokenizer: a router or an llm-d indexer that tokenizes with the real model
would compute other block hashes than engined's KV events carry. `--tokenizer builtin` is
the explicit opt-in to the embedded tokenizer under any served name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

BUILTIN: Final = "builtin"
DEFAULT_MODEL_DIR: Final = Path(__file__).resolve().parent / "default_model"
MODEL_FILES: Final = "config.json, tokenizer.json, tokenizer_config.json"
# A hub repository id: NAME or ORG/NAME (letters, digits, - _ .), never a path.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class TokenizerError(Exception):
    """No usable tokenizer; the message is one line saying what to pass instead."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved tokenizer source: `name` as the user gave it, `path` the directory."""

    name: str
    path: Path
    builtin: bool


def hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory, as `huggingface_hub` chooses it."""
    env = os.environ if environ is None else environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(os.path.expandvars(env[key])).expanduser()
    if env.get("HF_HOME"):
        home = Path(os.path.expandvars(env["HF_HOME"])).expanduser()
    else:
        cache = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
        home = Path(cache).expanduser() / "huggingface"
    return home / "hub"


def _cached_snapshot(name: str, cache: Path) -> Path | None:
    """The snapshot of hub repository `name` in `cache`: refs/main's, else the only one."""
    if not _REPO_ID.fullmatch(name) or ".." in name:
        return None
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    try:
        revision = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        revision = ""
    if revision:
        chosen = snapshots / revision
        return chosen if re.fullmatch(r"[0-9A-Za-z._-]+", revision) and chosen.is_dir() else None
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _not_found(name: str, cache: Path, flag: str) -> TokenizerError:
    return TokenizerError(
        f"{flag}{name} is not a local directory and is not in the Hugging Face cache "
        f"({cache}): pass a local model directory ({MODEL_FILES}), --tokenizer DIR, or "
        "--tokenizer builtin to serve it with engined's embedded tokenizer"
    )


def resolve(
    model: str | None, tokenizer: str | None, environ: Mapping[str, str] | None = None
) -> ModelSource:
    """The directory to load the tokenizer from (vLLM's MODEL positional and `--tokenizer`).

    The tokenizer comes from `tokenizer` when given, else from `model`; neither gives the
    embedded default. In order: a local directory, a hub name in the local cache, `builtin`.

    Raises:
        TokenizerError: the name is none of these.
    """
    name, flag = (tokenizer, "--tokenizer ") if tokenizer is not None else (model, "")
    if name is None or name == BUILTIN:
        return ModelSource(name=BUILTIN, path=DEFAULT_MODEL_DIR, builtin=True)
    if not name.strip():
        raise TokenizerError(
            f"{flag or 'the model'} is empty: pass a local model directory ({MODEL_FILES}), "
            "--tokenizer DIR, or --tokenizer builtin"
        )
    local = Path(name).expanduser()
    if local.is_dir():
        return ModelSource(name=name, path=local, builtin=False)
    cache = hub_cache(environ)
    snapshot = _cached_snapshot(name, cache)
    if snapshot is None:
        raise _not_found(name, cache, flag)
    return ModelSource(name=name, path=snapshot, builtin=False)
