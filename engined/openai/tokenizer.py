"""The model's tokenizer and chat template, for `engined serve`'s OpenAI API.

A model directory is read as vLLM reads it with a fast tokenizer: `tokenizer.json` through
the `tokenizers` package (encode, decode, incremental decode), the chat template and the
special tokens from `tokenizer_config.json` (or `chat_template.jinja`), and the vocabulary
facts the daemon needs (engined/model_dir.py, shared with the Dynamo worker). The embedded
default model (engined/openai/default_model/) is loaded by the same code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokenizers import Tokenizer as Backend

from engined.model_dir import ModelDirError, read_json, read_model
from engined.openai.chat_messages import prepare_messages
from engined.openai.chat_template import MISSING_TEMPLATE, ChatTemplateError, compile_template
from engined.openai.detokenizer import IncrementalDetokenizer, new_detokenizer
from engined.openai.model_source import MODEL_FILES, ModelSource, TokenizerError, resolve

__all__ = ["ChatTemplateError", "Tokenizer", "TokenizerError", "load_tokenizer"]

# transformers' named special tokens, given to every chat template by these names.
SPECIAL_TOKEN_NAMES: Final = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
_WHAT_TO_PASS: Final = (
    f"pass a local model directory ({MODEL_FILES}), --tokenizer DIR, or --tokenizer builtin"
)


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens transformers passes to the template: the named ones, and the
    model's own `*_token` entries (special_tokens_map.json's, overridden by the config's)."""
    found: dict[str, str] = {}
    for source in (read_json(path / "special_tokens_map.json"), config):
        for key, value in source.items():
            text = _token_text(value)
            if text is not None and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
                found[key] = text
        extra = source.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            found.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return found


def _chat_templates(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The model's chat template(s) as transformers loads them: chat_template.jinja and
    additional_chat_templates/*.jinja take priority over tokenizer_config.json's."""
    files: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        files["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, Mapping)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {str(t["name"]): str(t["template"]) for t in value}
    raise TokenizerError(
        f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of "
        f"{{name, template}} objects; {_WHAT_TO_PASS}"
    )


class Tokenizer:
    """One model directory's tokenizer, vocabulary facts and chat template(s)."""

    def __init__(self, source: ModelSource) -> None:
        """Raises: TokenizerError (one line saying what to pass)."""
        path = source.path
        self.name = source.name
        self.path = path
        self.builtin = source.builtin
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"{source.name}: no tokenizer.json in {path} (engined reads fast tokenizers "
                f"only); {_WHAT_TO_PASS}"
            )
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception for a bad file
            raise TokenizerError(
                f"{file}: cannot load it ({_one_line(str(exc))}); {_WHAT_TO_PASS}"
            ) from None
        # As transformers calls it: no truncation or padding unless asked for.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        size = backend.get_vocab_size(with_added_tokens=True)
        try:
            config = read_json(path / "tokenizer_config.json")
            info = read_model(path, name=source.name, tokenizer_size=size)
            self.special_tokens = _special_tokens(path, config)
        except ModelDirError as exc:
            raise TokenizerError(f"{exc}; {_WHAT_TO_PASS}") from None
        self._chat_template = _chat_templates(path, config)
        # transformers' default side for `truncate_prompt_tokens` without `truncation_side`.
        side = config.get("truncation_side")
        self.truncation_side: str = side if side in ("left", "right") else "right"
        self.vocab_size = info.vocab_size
        self.max_position_embeddings = info.max_position_embeddings
        self.excluded_token_ids = info.excluded_token_ids
        eos = self.special_tokens.get("eos_token")
        eos_id = None if eos is None else backend.token_to_id(eos)
        self.eos_token_ids = tuple(
            dict.fromkeys(([] if eos_id is None else [eos_id]) + list(info.eos_token_ids))
        )
        # vLLM's bound for ids a request may send: the larger of the two vocabularies.
        self.max_token_id = max(size, info.vocab_size) - 1
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        model = json.loads(backend.model.__getstate__()) if self._clean_up else {}
        # transformers skips the clean-up for BPE, which it would corrupt.
        self._clean_up = self._clean_up and model.get("type") != "BPE"
        self._space_marker = _space_marker(backend)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self._chat_template

    def check_token_ids(self, ids: Sequence[int]) -> None:
        """Raises: ValueError with vLLM's message for an id outside the vocabulary."""
        if not ids:
            return
        low, high = min(ids), max(ids)
        if low < 0:
            raise ValueError(f"Token id {low} is out of vocabulary")
        if high > self.max_token_id:
            raise ValueError(f"Token id {high} is out of vocabulary")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the post-processor's BOS/EOS when `add_special_tokens`."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, as transformers' decode gives it.

        Raises:
            ValueError: an id outside the vocabulary (vLLM's message).
        """
        self.check_token_ids(ids)
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `ids` ("" for an id the tokenizer lacks)."""
        self.check_token_ids(ids)
        return [self._backend.id_to_token(i) or "" for i in ids]

    def logprob_tokens(self, ids: Sequence[int]) -> list[str]:
        """The token strings vLLM reports in logprobs: each id decoded alone, with the
        leading spaces a SentencePiece marker stands for kept."""
        raw = self.convert_ids_to_tokens(ids)
        texts = [self.decode([i], skip_special_tokens=False) for i in ids]
        if self._space_marker is None:
            return texts
        out: list[str] = []
        for piece, text in zip(raw, texts, strict=True):
            markers = len(piece) - len(piece.lstrip(self._space_marker))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            out.append(" " * missing + text if missing > 0 else text)
        return out

    def detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A detokenizer for one request's output; `push(new_ids)` returns the text delta."""
        self.check_token_ids(prompt_ids)
        return new_detokenizer(self._backend, prompt_ids, skip_special_tokens)

    def _template_source(self, chat_template: str | None, tools: object) -> str | None:
        """vLLM's choice: the request's template (or the name of one of the model's), else the
        model's (its `tool_use` one when tools are given, else its `default`)."""
        templates = self._chat_template
        if chat_template is not None:
            if isinstance(templates, dict):
                return templates.get(chat_template, chat_template)
            return chat_template
        if not isinstance(templates, dict):
            return templates
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        return templates.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat request, as vLLM renders it.

        Raises:
            ChatTemplateError: no template, or the template refused the request; the message
                is vLLM's.
        """
        source = self._template_source(chat_template, tools)
        if source is None:
            raise ChatTemplateError(MISSING_TEMPLATE)
        template = compile_template(source)
        kwargs = template.template_kwargs(chat_template_kwargs or {})
        prepared = prepare_messages(
            messages,
            template.content_format,
            supports_developer_role=template.supports_developer_role,
        )
        return template.render(
            prepared,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools if tools is not None else kwargs.get("tools"),
            documents=documents if documents is not None else kwargs.get("documents"),
            variables={**self.special_tokens, **kwargs},
        )


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`, for tokenizers whose config asks for it."""
    for dirty, clean in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(dirty, clean)
    return text


def _space_marker(backend: Backend) -> str | None:
    """The Metaspace replacement character ("▁") whose leading copies decode() strips."""
    state = backend.pre_tokenizer
    if state is None:
        return None
    config = json.loads(state.__getstate__())
    candidates = (
        config.get("pretokenizers", [config]) if config.get("type") == "Sequence" else [config]
    )
    for item in candidates:
        if isinstance(item, dict) and item.get("type") == "Metaspace":
            return str(item.get("replacement", "\u2581"))
    return None


def load_tokenizer(model: str | None, tokenizer: str | None) -> Tokenizer:
    """The tokenizer of vLLM's `MODEL` positional and `--tokenizer` (engined/openai/model_source.py
    says where it is looked for).

    Raises:
        TokenizerError: nothing usable there; one line saying what to pass.
    """
    return Tokenizer(resolve(model, tokenizer))
