"""Build engined's embedded default model from words.txt, offline and byte-for-byte reproducibly.

    python engined/openai/default_model/build.py [DIR]    (default: beside this file)

`engined serve` with no model answers OpenAI requests with this directory, loaded by the same
code as any local model directory. No weights: the files say what the ids mean.

The tokenizer is a `tokenizers` WordLevel model: every token is a whole word, a punctuation
mark, a digit, a newline or an English contraction ending (`n't`, `'s`, ...), so an English
prompt costs about one token a word, and any sequence of drawable ids decodes to text that
encodes back to the same ids (a benchmark client that counts output tokens by re-encoding
counts exactly what engined generated). Text is lower-cased first; words outside the
vocabulary become `<unk>`, a special token, dropped when decoding with
`skip_special_tokens`. Decoding joins tokens with spaces, without one before `. , ? !`, the
contraction endings and a newline, so random ids read as random words. The chat template is
ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), as Qwen's instruct models use.
"""

from __future__ import annotations

import json
import re
import string
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK, ENDOFTEXT, IM_START, IM_END = range(len(SPECIAL_TOKENS))
# \u2019 is not among them: the normalizer makes it an apostrophe.
PUNCTUATION = (*string.punctuation, "\u2018", "\u201c", "\u201d", "\u2013", "\u2014", "\u2026")
DIGITS = tuple(string.digits)
# English contraction endings, and the stems whose split keeps `can't`, `won't` and `shan't`.
CONTRACTIONS = ("n't", "'s", "'m", "'re", "'ve", "'ll", "'d")
CONTRACTION_STEMS = ("ca", "wo", "sha")
# One pre-token each: a word before `n't`, a contraction ending, a word, a digit, a newline,
# one other non-space character. Other whitespace separates pre-tokens and is dropped.
PRE_TOKEN = r"\p{L}+(?=n't)|n't|'(?:s|m|re|ve|ll|d)|\p{L}+|\p{N}|\n|[^\s\p{L}\p{N}]"
MAX_POSITION_EMBEDDINGS = 32768
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def words(path: Path = HERE / "words.txt") -> list[str]:
    """The words of words.txt, in order, without repeats (lines starting with # are notes)."""
    found: dict[str, None] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#"):
            continue
        for word in line.split():
            if not re.fullmatch("[a-z]+", word):
                raise ValueError(f"{path}:{number}: {word!r} is not a lower-case word")
            found[word] = None
    return list(found)


def vocabulary() -> dict[str, int]:
    tokens = [*SPECIAL_TOKENS, "\n", *PUNCTUATION, *DIGITS, *CONTRACTIONS, *CONTRACTION_STEMS]
    tokens += [w for w in words() if w not in tokens]
    return {token: index for index, token in enumerate(tokens)}


def tokenizer() -> Tokenizer:
    built = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=SPECIAL_TOKENS[UNK]))
    built.normalizer = normalizers.Sequence(
        [normalizers.Replace("\u2019", "'"), normalizers.Lowercase()]
    )
    built.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKEN), "removed", invert=True)
    # WordPiece's decoder puts a space before every token ("##" never occurs here) and, with
    # cleanup, removes it again before . , ? ! and the contraction endings, token by token.
    built.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="##", cleanup=True), decoders.Replace(" \n", "\n")]
    )
    built.add_special_tokens(list(SPECIAL_TOKENS))
    return built


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(directory: Path = HERE) -> Path:
    """Write the four files into `directory` (created if needed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    built = tokenizer()
    built.save(str(directory / "tokenizer.json"), pretty=False)
    vocab_size = built.get_vocab_size(with_added_tokens=True)
    _write_json(
        directory / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "bos_token_id": None,
            "eos_token_id": IM_END,
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
        {"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT},
    )
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": SPECIAL_TOKENS[IM_END],
            "pad_token": SPECIAL_TOKENS[ENDOFTEXT],
            "unk_token": SPECIAL_TOKENS[UNK],
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITION_EMBEDDINGS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
