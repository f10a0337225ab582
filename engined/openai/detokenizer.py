"""Incremental detokenization: the text each pass of generated ids adds, as vLLM streams it.

vLLM's FastIncrementalDetokenizer steps a `tokenizers.decoders.DecodeStream` primed with the
prompt ids, so the first generated token gets the space the prompt's context gives it. With
a `tokenizers` release that has no DecodeStream (before 0.21) or cannot prime one (before
0.22), the text is taken the older way (text-generation-inference's and vLLM's slow path):
decode a window of ids ending at the newest and emit what it added past the previous
window, holding back while the text ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from tokenizers import Tokenizer as Backend
from tokenizers import decoders

# The prompt ids a window keeps before the first generated one (vLLM's offset, 5).
CONTEXT_IDS: Final = 5
_INVALID_PREFIX: Final = "Invalid prefix encountered"


class IncrementalDetokenizer(Protocol):
    def push(self, new_ids: Sequence[int]) -> str:
        """The text `new_ids` add to the output (may be "" while a character is incomplete)."""
        ...


class StreamDetokenizer:
    """Through `DecodeStream` (what vLLM uses with a fast tokenizer)."""

    def __init__(
        self, backend: Backend, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        try:
            self._stream = decoders.DecodeStream(
                ids=list(prompt_ids), skip_special_tokens=skip_special_tokens
            )
        except TypeError:  # tokenizers < 0.22: prime it by stepping the last prompt ids
            self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in prompt_ids[-CONTEXT_IDS:]:
                self._stream.step(backend, token_id)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # Non-monotonic UTF-8 from some tokenizers breaks the stream: vLLM starts anew.
            self._stream = decoders.DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id) or ""

    def push(self, new_ids: Sequence[int]) -> str:
        return "".join(self._step(token_id) for token_id in new_ids)


class WindowDetokenizer:
    """By decoding windows of ids (no DecodeStream in the installed `tokenizers`)."""

    def __init__(
        self, backend: Backend, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-CONTEXT_IDS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        out: list[str] = []
        for token_id in new_ids:
            self._ids.append(token_id)
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                out.append(after[len(before) :])
                self._prefix, self._read = self._read, len(self._ids)
        # Only the window is needed: drop what lies before it.
        if self._prefix > 4 * CONTEXT_IDS:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return "".join(out)


def new_detokenizer(
    backend: Backend,
    prompt_ids: Sequence[int],
    skip_special_tokens: bool,
    *,
    use_stream: bool | None = None,
) -> IncrementalDetokenizer:
    """DecodeStream's detokenizer when `tokenizers` has one (or `use_stream` says which)."""
    if use_stream is None:
        use_stream = hasattr(decoders, "DecodeStream")
    if use_stream:
        return StreamDetokenizer(backend, prompt_ids, skip_special_tokens)
    return WindowDetokenizer(backend, prompt_ids, skip_special_tokens)
