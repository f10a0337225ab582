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
id, as vLLM decodes each id on its own; with `as_token_ids` (vLLM's
`return_tokens_as_token_ids`) every token is named `token_id:{id}` instead, except a chat
token's own `bytes`, which vLLM still takes from its text. The values themselves are
`engined.logprob_values`'s, which the Dynamo worker (engined/dynamo/engine_outputs.py) sends
by token id for Dynamo's frontend to render.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engined.logprob_values import PositionLogprobs, position_logprobs
from engined.openai.protocol_responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)

Decode = Callable[[list[int]], list[str]]


def token_id_names(ids: list[int]) -> list[str]:
    """vLLM's `format_token_id_placeholder` of each id: a `Decode` naming tokens by id."""
    return [f"token_id:{token_id}" for token_id in ids]


__all__ = ["PositionLogprobs", "chat_logprobs", "completion_logprobs", "position_logprobs"]


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
    as_token_ids: bool = False,
) -> CompletionLogProbs:
    """`/v1/completions` logprobs of `token_ids`, the first at `first_position`.

    `text_offset` is where the first token starts in the choice's text (a stream's next
    chunk starts at the last offset plus the last token's length). `first_is_none` marks an
    echoed prompt's first token, which has no logprob in vLLM.
    """
    if as_token_ids:
        decode = token_id_names
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
    as_token_ids: bool = False,
) -> ChatCompletionLogProbs:
    """`/v1/chat/completions` logprobs of `token_ids`, the first at `first_position`."""
    name = token_id_names if as_token_ids else decode
    content: list[ChatCompletionLogProbsContent] = []
    for index, token_id in enumerate(token_ids):
        position = position_logprobs(
            token_id, first_position + index, k, key=key, vocab_size=vocab_size
        )
        kept = position.entries[: max(k, 1)]
        names = name([entry[0] for entry in kept])
        top = [
            ChatCompletionLogProb(token=text, logprob=lp, bytes=_utf8(text))
            for text, (_, lp) in zip(names[:k], kept[:k], strict=True)
        ]
        # The token's bytes are its text's, named by id or not (vLLM's `decoded_token`).
        text = decode([token_id])[0] if as_token_ids else names[0]
        content.append(
            ChatCompletionLogProbsContent(
                token=names[0], logprob=position.logprob, bytes=_utf8(text), top_logprobs=top
            )
        )
    return ChatCompletionLogProbs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
