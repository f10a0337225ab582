"""Logprobs for a simulated engine: made up, deterministic, and shaped as vLLM 0.33's.

A simulated engine samples nothing, yet clients asking for `logprobs` expect values that
hold together. For each generated (or echoed) token this makes up a distribution from the
request's key and the token's position alone: a top-1 probability in [0.5, 0.98] and the
rest of the mass decaying geometrically over the next ranks, so every logprob is below 0,
they strictly decrease with rank and their probabilities sum to less than 1. The key should
differ between a request's choices (the request id's hash plus the choice's index, say, or
its `seed`); the position is the token's index in the choice's output. The sampled
token takes rank 1 three times in four and a lower rank otherwise, and so the logprob of
that rank; the other ranks hold distinct token ids drawn from the vocabulary.

Then vLLM's semantics: its engine reports, per position, the sampled token first and then
the top `k` in rank order (the sampled one not repeated), and the APIs cut that list:
completions keep the first `k + 1` (keyed by token text, so two ids of one text merge),
chat the first `k`, so a chat `top_logprobs` list starts with the sampled token even when it
was not the most likely. Token text comes from the caller's `decode(ids)`, one string per
id, as vLLM decodes each id on its own. The Dynamo worker (engined/dynamo/choices.py) sends
the same values by token id, for Dynamo's frontend to render.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

from engined.openai.protocol_responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)

Decode = Callable[[list[int]], list[str]]

_MASK: Final = (1 << 64) - 1
_UNIT: Final = float(1 << 53)
# Logprobs are cut (down, so the probabilities still sum below 1) to 4 decimals, which
# every JSON encoder writes alike.
_SCALE: Final = 10_000


def _mix(value: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value from any integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def _unit(state: int) -> float:
    return (state >> 11) / _UNIT


class PositionLogprobs(NamedTuple):
    """One position as vLLM's engine reports it: the sampled token's logprob and rank, and
    `(token_id, logprob)` pairs, the sampled token first, then the top k in rank order;
    `ranks` holds each entry's rank."""

    logprob: float
    rank: int
    entries: list[tuple[int, float]]
    ranks: list[int]


def position_logprobs(
    token_id: int, position: int, k: int, *, key: int, vocab_size: int
) -> PositionLogprobs:
    """The made-up distribution at `position` of the request with `key`, `k` ranks deep."""
    k = max(0, min(k, vocab_size - 1))
    state = _mix(key * 0x100000001B3 ^ position)
    top = 0.5 + 0.48 * _unit(state)
    state = _mix(state)
    decay = 0.3 + 0.4 * _unit(state)
    state = _mix(state)
    draw = _unit(state)
    rank = 1 if draw < 0.75 else 2 if draw < 0.9 else 3 + int((draw - 0.9) * 80)
    rank = min(rank, vocab_size)

    def logprob(r: int) -> float:
        mass = top if r == 1 else (1 - top) * (1 - decay) * decay ** (r - 2)
        return math.floor(math.log(mass) * _SCALE) / _SCALE

    entries = [(token_id, logprob(rank))]
    ranks = [rank]
    taken = {token_id}
    for r in range(1, k + 1):
        if r == rank:
            continue
        state = _mix(state)
        other = state % vocab_size
        while other in taken:
            other = (other + 1) % vocab_size
        taken.add(other)
        entries.append((other, logprob(r)))
        ranks.append(r)
    return PositionLogprobs(entries[0][1], rank, entries, ranks)


def completion_logprobs(
    token_ids: Sequence[int],
    first_position: int,
    k: int,
    *,
    key: int,
    vocab_size: int,
    decode: Decode,
    text_offset: int = 0,
    first_is_none: bool = False,
) -> CompletionLogProbs:
    """`/v1/completions` logprobs of `token_ids`, the first at `first_position`.

    `text_offset` is where the first token starts in the choice's text (a stream's next
    chunk starts at the last offset plus the last token's length). `first_is_none` marks an
    echoed prompt's first token, which has no logprob in vLLM.
    """
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    for index, token_id in enumerate(token_ids):
        offsets.append(text_offset)
        if index == 0 and first_is_none:
            text = decode([token_id])[0]
            logprobs.append(None)
            tops.append(None)
        else:
            position = position_logprobs(
                token_id, first_position + index, k, key=key, vocab_size=vocab_size
            )
            kept = position.entries[: k + 1]
            texts = decode([entry[0] for entry in kept])
            text = texts[0]
            logprobs.append(position.logprob)
            tops.append({texts[i]: kept[i][1] for i in range(len(kept))})
        tokens.append(text)
        text_offset += len(text)
    return CompletionLogProbs(
        text_offset=offsets, token_logprobs=logprobs, tokens=tokens, top_logprobs=tops
    )


def chat_logprobs(
    token_ids: Sequence[int],
    first_position: int,
    k: int,
    *,
    key: int,
    vocab_size: int,
    decode: Decode,
) -> ChatCompletionLogProbs:
    """`/v1/chat/completions` logprobs of `token_ids`, the first at `first_position`."""
    content: list[ChatCompletionLogProbsContent] = []
    for index, token_id in enumerate(token_ids):
        position = position_logprobs(
            token_id, first_position + index, k, key=key, vocab_size=vocab_size
        )
        kept = position.entries[: max(k, 1)]
        texts = decode([entry[0] for entry in kept])
        top = [
            ChatCompletionLogProb(token=text, logprob=lp, bytes=_utf8(text))
            for text, (_, lp) in zip(texts[:k], kept[:k], strict=True)
        ]
        content.append(
            ChatCompletionLogProbsContent(
                token=texts[0], logprob=position.logprob, bytes=_utf8(texts[0]), top_logprobs=top
            )
        )
    return ChatCompletionLogProbs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
