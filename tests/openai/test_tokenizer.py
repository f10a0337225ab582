"""engined serve's tokenizers: where they come from, what they say, and how they fail."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engined.openai.default_model import build
from engined.openai.detokenizer import new_detokenizer
from engined.openai.model_source import DEFAULT_MODEL_DIR, TokenizerError, hub_cache
from engined.openai.tokenizer import Tokenizer, load_tokenizer
from tests.interop.tiny_model import build_tiny_model

WHAT_TO_PASS = (
    "pass a local model directory (config.json, tokenizer.json, tokenizer_config.json), "
    "--tokenizer DIR, or --tokenizer builtin"
)


@pytest.fixture(scope="module")
def builtin() -> Tokenizer:
    return load_tokenizer(None, None)


def test_the_embedded_model_is_what_its_files_say(builtin: Tokenizer) -> None:
    assert (builtin.name, builtin.builtin, builtin.path) == ("builtin", True, DEFAULT_MODEL_DIR)
    assert builtin.vocab_size == 4524
    assert builtin.max_token_id == 4523
    assert builtin.max_position_embeddings == 32768
    # <|im_end|> (the tokenizer's and config's EOS), then <|endoftext|> (generation config's).
    assert builtin.eos_token_ids == (3, 1)
    assert builtin.excluded_token_ids == (0, 1, 2, 3)
    assert builtin.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<unk>",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert load_tokenizer("served-name", "builtin").path == DEFAULT_MODEL_DIR


def test_the_embedded_model_round_trips_english(builtin: Tokenizer) -> None:
    text = "what is the capital of france? it's paris, i don't know... can't you see!"
    ids = builtin.encode(text)
    assert builtin.decode(ids) == text
    # A newline is a token; the word after it gets its space, as after any token.
    assert builtin.decode(builtin.encode("yes.\nno")) == "yes.\n no"
    assert builtin.convert_ids_to_tokens(builtin.encode("Hello, World!")) == [
        "hello",
        ",",
        "world",
        "!",
    ]
    assert builtin.convert_ids_to_tokens(builtin.encode("Don't 42")) == ["do", "n't", "4", "2"]
    # A word it lacks is <unk>, a special token: dropped unless asked for.
    assert builtin.encode("zyzzyva") == [0]
    assert builtin.decode([0, builtin.encode("cat")[0]]) == "cat"
    assert builtin.decode([0], skip_special_tokens=False) == "<unk>"


def test_any_drawable_ids_decode_to_text_that_encodes_back_to_them(builtin: Tokenizer) -> None:
    """What the daemon draws (never an excluded id) re-tokenizes to exactly as many tokens."""
    rng = random.Random(7)
    drawable = [i for i in range(builtin.vocab_size) if i not in builtin.excluded_token_ids]
    for _ in range(300):
        ids = [rng.choice(drawable) for _ in range(64)]
        assert builtin.encode(builtin.decode(ids)) == ids


def test_the_embedded_model_is_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    build.build(tmp_path)
    for name in build.FILES:
        assert (tmp_path / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes(), name
    assert sum((DEFAULT_MODEL_DIR / name).stat().st_size for name in build.FILES) < 300_000


def _bos_model(directory: Path, *, clean_up: bool = False) -> Path:
    """A WordLevel model whose post-processor adds <s> (as Llama's does), with a period."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4, ".": 5}
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>", "clean_up_tokenization_spaces": clean_up}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_local_model_directory_loads(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "tiny", vocab_words=20, max_position_embeddings=512)
    tokenizer = load_tokenizer(str(path), None)
    assert (tokenizer.name, tokenizer.path, tokenizer.builtin) == (str(path), path, False)
    assert (tokenizer.vocab_size, tokenizer.max_position_embeddings) == (23, 512)
    assert (tokenizer.eos_token_ids, tokenizer.excluded_token_ids) == ((2,), (0, 1, 2))
    assert tokenizer.encode("w0 w5") == [3, 8]
    assert tokenizer.decode([3, 8, 2]) == "w0 w5"
    # --tokenizer wins over the model.
    assert load_tokenizer("anything/else", str(path)).path == path


def test_special_tokens_are_added_as_the_post_processor_says(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(_bos_model(tmp_path / "bos")), None)
    # No config.json: the vocabulary is the tokenizer's; EOS from tokenizer_config.json.
    assert (tokenizer.vocab_size, tokenizer.eos_token_ids) == (6, (2,))
    assert tokenizer.excluded_token_ids == (0, 1, 2)
    assert tokenizer.encode("hi there") == [1, 3, 4]
    assert tokenizer.encode("hi there", add_special_tokens=False) == [3, 4]
    assert tokenizer.decode([1, 3, 4, 5]) == "hi there ."
    assert tokenizer.decode([1, 3, 4, 5], skip_special_tokens=False) == "<s> hi there ."


def test_clean_up_tokenization_spaces_is_honoured(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(_bos_model(tmp_path / "bos", clean_up=True)), None)
    assert tokenizer.decode([3, 4, 5]) == "hi there."


def test_ids_outside_the_vocabulary_are_refused_with_vllms_message(builtin: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"^Token id -1 is out of vocabulary$"):
        builtin.decode([5, -1])
    with pytest.raises(ValueError, match=r"^Token id 4524 is out of vocabulary$"):
        builtin.convert_ids_to_tokens([4524])
    with pytest.raises(ValueError, match=r"^Token id 4294967296 is out of vocabulary$"):
        builtin.detokenizer([2**32])


def _fake_hub(cache: Path, repo: str, revisions: list[str], main: str | None) -> list[Path]:
    """A Hugging Face hub cache entry for `repo` with a tokenizer in each snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshots = []
    for revision in revisions:
        snapshot = root / "snapshots" / revision
        build.build(snapshot)
        snapshots.append(snapshot)
    if main is not None:
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(main + "\n")
    return snapshots


def test_hub_names_resolve_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    old, new = _fake_hub(tmp_path / "hub", "Org/Model-1.5B", ["aaa111", "bbb222"], "bbb222")
    tokenizer = load_tokenizer("Org/Model-1.5B", None)
    assert (tokenizer.name, tokenizer.path) == ("Org/Model-1.5B", new)
    # Without refs/main, the only snapshot.
    (only,) = _fake_hub(tmp_path / "hub", "gpt-tiny", ["ccc333"], None)
    assert load_tokenizer(None, "gpt-tiny").path == only
    # HF_HOME/hub when HF_HUB_CACHE is unset.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    (home,) = _fake_hub(tmp_path / "home" / "hub", "Org/Other", ["ddd444"], "ddd444")
    assert hub_cache() == tmp_path / "home" / "hub"
    assert load_tokenizer("Org/Other", None).path == home
    assert old.is_dir()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Org/Missing", id="not-cached"),
        pytest.param("../../etc", id="a-path"),
        pytest.param("Org/Two", id="two-snapshots-no-main"),
        pytest.param("Org/Dangling", id="main-names-no-snapshot"),
    ],
)
def test_a_name_found_nowhere_gets_one_line_saying_what_to_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub(tmp_path / "hub", "Org/Two", ["a1", "b2"], None)
    _fake_hub(tmp_path / "hub", "Org/Dangling", ["a1"], "ffff")
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer(name, None)
    assert str(refused.value) == (
        f"{name} is not a local directory and is not in the Hugging Face cache "
        f"({tmp_path / 'hub'}): {WHAT_TO_PASS} to serve it with engined's embedded tokenizer"
    )
    with pytest.raises(TokenizerError, match=r"^--tokenizer Org/Missing is not a local dir"):
        load_tokenizer("builtin", "Org/Missing")


def test_broken_directories_get_one_line_naming_the_file(tmp_path: Path) -> None:
    def refusal(path: Path) -> str:
        with pytest.raises(TokenizerError) as refused:
            load_tokenizer(str(path), None)
        message = str(refused.value)
        assert "\n" not in message and message.endswith(WHAT_TO_PASS)
        return message

    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(empty) == (
        f"{empty}: no tokenizer.json in {empty} (engined reads fast tokenizers only); "
        + WHAT_TO_PASS
    )
    bad_config = _bos_model(tmp_path / "bad-config")
    (bad_config / "tokenizer_config.json").write_text("{not json")
    assert refusal(bad_config).startswith(
        f"{bad_config / 'tokenizer_config.json'}: cannot read it as JSON (Expecting property"
    )
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    assert refusal(bad_config).startswith(
        f"{bad_config / 'tokenizer_config.json'}: expected a JSON object;"
    )
    bad_vocab = _bos_model(tmp_path / "bad-vocab")
    (bad_vocab / "config.json").write_text('{"vocab_size": "many"}')
    assert refusal(bad_vocab).startswith(
        f"{bad_vocab / 'config.json'}: vocab_size must be a positive int, got 'many';"
    )
    bad_tokenizer = _bos_model(tmp_path / "bad-tokenizer")
    (bad_tokenizer / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}\n' * 3)
    assert refusal(bad_tokenizer).startswith(
        f"{bad_tokenizer / 'tokenizer.json'}: cannot load it ("
    )
    bad_template = _bos_model(tmp_path / "bad-template")
    (bad_template / "tokenizer_config.json").write_text('{"chat_template": 42}')
    assert refusal(bad_template) == (
        f"{bad_template / 'tokenizer_config.json'}: chat_template must be a string or a list "
        f"of {{name, template}} objects; {WHAT_TO_PASS}"
    )
    with pytest.raises(TokenizerError, match=r"^the model is empty: pass a local model"):
        load_tokenizer(" ", None)


def _byte_level_model() -> Backend:
    """A byte-level BPE with no merges: one token a byte, so a token may split a character."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=257,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=["<eos>"],
    )
    backend.train_from_iterator(["café naïve déjà vu 🙂 日本語 text"] * 10, trainer=trainer)
    return backend


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "windows"])
def test_detokenizer_deltas_concatenate_to_the_decoded_text(
    builtin: Tokenizer, use_stream: bool
) -> None:
    prompt = builtin.encode("the answer is")
    output = builtin.encode("yes, it's forty two... or 4 2 !")
    backend = Backend.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    detokenizer = new_detokenizer(backend, prompt, True, use_stream=use_stream)
    deltas = [detokenizer.push(output[i : i + 3]) for i in range(0, len(output), 3)]
    assert "".join(deltas) == " " + builtin.decode(output)
    assert builtin.decode(prompt + output) == builtin.decode(prompt) + "".join(deltas)

    emoji = _byte_level_model()
    ids = emoji.encode("déjà vu 🙂 日本語 café").ids
    detokenizer = new_detokenizer(emoji, [], True, use_stream=use_stream)
    pieces = [detokenizer.push([i]) for i in ids]
    assert "".join(pieces) == "déjà vu 🙂 日本語 café"
    assert "\ufffd" not in "".join(pieces)
    assert len(ids) > len(pieces) - pieces.count("")


def test_huge_inputs_are_handled(builtin: Tokenizer) -> None:
    text = "the cat sat on the floor. " * 40_330  # 1 MB
    assert len(text) == 1_048_580
    ids = builtin.encode(text)
    assert len(ids) == 7 * 40_330
    assert builtin.decode(ids) == text.strip()
    detokenizer = builtin.detokenizer(ids)
    assert detokenizer.push(builtin.encode("yes")) == " yes"
    prompt = builtin.apply_chat_template([{"role": "user", "content": text}])
    assert len(prompt) == len(text) + len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
