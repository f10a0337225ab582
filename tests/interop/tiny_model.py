"""A tiny local model directory for NVIDIA Dynamo's frontend and workers, built offline.

No weights: Dynamo's frontend and mocker only read the tokenizer and the config files
(`docs/upstream/dynamo-1.6.1.md` §1). The tokenizer is a `tokenizers` WordLevel
model over `<unk> <s> </s>` (ids 0, 1, 2) and the words `w0 .. w{vocab_words - 1}` (ids from
3), split on whitespace, decoded by joining the words with spaces. No special token is added
on encode, so a prompt of N words is exactly N token ids: `words(n)` builds one.

`tokenizers` is one of engined's dependencies (engined serve's tokenizers), so the model is
built in-process; an interpreter that cannot import it runs this file under the peers python
(`python tiny_model.py DIR --vocab-words N --max-position-embeddings M`). The script half
uses the standard library and `tokenizers` only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD_ID = len(SPECIAL_TOKENS)
DEFAULT_VOCAB_WORDS = 997
# Prompts are the contents of the messages separated by spaces, after the BOS token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }} {% endfor %}{% endif %}"
    "{% if not loop.last %} {% endif %}{% endfor %}"
)
TOKENIZERS_INSTALL = ".venv-peers/bin/pip install -e '.[dynamo]'"
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


def word(token_id: int) -> str:
    """The word of a non-special token id (3 -> "w0")."""
    return f"w{token_id - FIRST_WORD_ID}"


def words(n: int, *, start: int = 0, vocab_words: int = DEFAULT_VOCAB_WORDS) -> str:
    """n space-separated vocabulary words (`w{start} w{start+1} ...`, wrapping): n tokens."""
    return " ".join(f"w{(start + i) % vocab_words}" for i in range(n))


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _build_here(directory: Path, vocab_words: int, max_position_embeddings: int) -> None:
    """Write the four files with `tokenizers` (must be importable in this interpreter)."""
    from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
    )

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": FIRST_WORD_ID + i for i in range(vocab_words)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins tokens with a space (no "##" continuation in this vocab).
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))

    vocab_size = FIRST_WORD_ID + vocab_words
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        directory / "config.json",
        {
            # A plain Llama layout: what Dynamo (and transformers, if anything asks) knows.
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "max_position_embeddings": max_position_embeddings,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "torch_dtype": "float16",
            "tie_word_embeddings": False,
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
    )
    # Round trip: N words are N ids, and decoding gives the words back.
    probe = f"w0 w{vocab_words - 1}"
    ids = tokenizer.encode(probe).ids
    assert ids == [FIRST_WORD_ID, vocab_size - 1], ids
    assert tokenizer.decode(ids) == probe, tokenizer.decode(ids)


def build_tiny_model(
    directory: Path,
    *,
    vocab_words: int = DEFAULT_VOCAB_WORDS,
    max_position_embeddings: int = 4096,
    python: Path | None = None,
) -> Path:
    """Write the tiny model into `directory` (created if needed) and return it.

    Built in this interpreter when it has `tokenizers`, else by running this file under
    `python` (default: the peers venv's, `tests.interop.peers.DEFAULT_PEERS_PYTHON` or
    `INTEROP_PEERS_PYTHON`).
    """
    directory = Path(directory)
    if python is None and importlib.util.find_spec("tokenizers") is not None:
        _build_here(directory, vocab_words, max_position_embeddings)
        return directory
    if python is None:
        from tests.interop.peers import require_peers

        python = require_peers()
    run = subprocess.run(
        [
            str(python),
            str(Path(__file__).resolve()),
            str(directory),
            "--vocab-words",
            str(vocab_words),
            "--max-position-embeddings",
            str(max_position_embeddings),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode != 0:
        raise RuntimeError(build_failure(python, run.stderr))
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise RuntimeError(f"the tiny model in {directory} lacks {missing}")
    return directory


def build_failure(python: Path, stderr: str) -> str:
    """Why building under `python` failed; without `tokenizers` there, how to install it."""
    message = f"building the tiny model under {python} failed:\n{stderr}"
    if "No module named 'tokenizers'" in stderr:
        message += (
            f"\n{python} lacks `tokenizers`, which comes with engined: install the peers venv "
            "as the README's 'Behind NVIDIA Dynamo' install does, e.g. "
            f"{TOKENIZERS_INSTALL}"
        )
    return message


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-words", type=int, default=DEFAULT_VOCAB_WORDS)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    args = parser.parse_args(argv)
    _build_here(args.directory, args.vocab_words, args.max_position_embeddings)
    print(args.directory)


if __name__ == "__main__":
    main()
