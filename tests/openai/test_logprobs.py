"""Made-up logprobs: deterministic, well formed, and cut as vLLM 0.33 cuts its engine's."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from engined.openai.logprobs import chat_logprobs, completion_logprobs, position_logprobs
from engined.openai.protocol_responses import ENCODE

VOCAB = 1000


def _decode(ids: list[int]) -> list[str]:
    return [f"<{i}>" for i in ids]


def test_the_same_request_gets_the_same_values() -> None:
    assert position_logprobs(42, 0, 3, key=7, vocab_size=VOCAB) == (
        -2.1472,
        2,
        [(42, -2.1472), (166, -0.3753), (446, -2.6146)],
        [2, 1, 3],
    )
    assert position_logprobs(42, 1, 3, key=7, vocab_size=VOCAB) == (
        -0.1143,
        1,
        [(42, -0.1143), (947, -3.3066), (142, -3.7214)],
        [1, 2, 3],
    )
    assert position_logprobs(42, 0, 3, key=8, vocab_size=VOCAB) != position_logprobs(
        42, 0, 3, key=7, vocab_size=VOCAB
    )


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_every_position_is_a_distribution_with_vllms_ranks(k: int) -> None:
    for position in range(2000):
        sampled = position % VOCAB
        logprob, rank, entries, ranks = position_logprobs(
            sampled, position, k, key=3, vocab_size=VOCAB
        )
        assert entries[0] == (sampled, logprob)
        assert ranks[0] == rank
        assert sorted(ranks[1:]) == ranks[1:] and rank not in ranks[1:]
        assert ranks[1:] == [r for r in range(1, k + 1) if r != rank][: len(ranks) - 1]
        others = entries[1:]
        assert len(entries) == (k if rank <= k else k + 1) or (k == 0 and len(entries) == 1)
        assert len({token for token, _ in entries}) == len(entries)
        assert all(0 <= token < VOCAB for token, _ in entries)
        values = [lp for _, lp in others]
        assert values == sorted(values, reverse=True)
        ranked = sorted([lp for _, lp in entries], reverse=True)
        assert all(lp < 0 for lp in ranked)
        assert len(set(ranked)) == len(ranked)
        if rank <= k:
            assert ranked.index(logprob) == rank - 1
        else:
            assert logprob < min(values, default=0.0)
        assert sum(math.exp(lp) for lp in ranked) < 1.0


def test_the_sampled_token_is_usually_the_most_likely() -> None:
    ranks = Counter(position_logprobs(1, p, 5, key=7, vocab_size=VOCAB).rank for p in range(10000))
    assert (ranks[1], ranks[2], sum(ranks.values())) == (7539, 1459, 10000)
    assert max(ranks) == 10


def test_completion_logprobs_keep_k_plus_one_keyed_by_text() -> None:
    logprobs = completion_logprobs([42, 43, 44], 0, 2, key=7, vocab_size=VOCAB, decode=_decode)
    assert ENCODE(logprobs) == (
        b'{"text_offset":[0,4,8],"token_logprobs":[-2.1472,-0.1143,-0.1075],'
        b'"tokens":["<42>","<43>","<44>"],"top_logprobs":[{"<42>":-2.1472,"<166>":-0.3753},'
        b'{"<43>":-0.1143,"<947>":-3.3066},{"<44>":-0.1075,"<912>":-2.7993}]}'
    )
    later = completion_logprobs([44], 2, 2, key=7, vocab_size=VOCAB, decode=_decode, text_offset=8)
    assert (later.text_offset, later.token_logprobs) == ([8], [-0.1075])
    one = completion_logprobs([42], 0, 0, key=7, vocab_size=VOCAB, decode=_decode)
    assert one.top_logprobs == [{"<42>": -2.1472}]


def test_an_echoed_prompt_starts_without_a_logprob() -> None:
    logprobs = completion_logprobs(
        [5, 42], 0, 1, key=7, vocab_size=VOCAB, decode=_decode, first_is_none=True
    )
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert (logprobs.tokens, logprobs.text_offset) == (["<5>", "<42>"], [0, 3])


def test_texts_of_one_string_merge_as_in_vllms_dict() -> None:
    logprobs = completion_logprobs(
        [42], 0, 2, key=7, vocab_size=VOCAB, decode=lambda ids: ["same"] * len(ids)
    )
    assert logprobs.top_logprobs == [{"same": -0.3753}]


def test_chat_logprobs_keep_k_the_sampled_token_first() -> None:
    logprobs = chat_logprobs([42, 43], 0, 2, key=7, vocab_size=VOCAB, decode=_decode)
    assert ENCODE(logprobs) == (
        b'{"content":[{"token":"<42>","logprob":-2.1472,"bytes":[60,52,50,62],'
        b'"top_logprobs":[{"token":"<42>","logprob":-2.1472,"bytes":[60,52,50,62]},'
        b'{"token":"<166>","logprob":-0.3753,"bytes":[60,49,54,54,62]}]},'
        b'{"token":"<43>","logprob":-0.1143,"bytes":[60,52,51,62],'
        b'"top_logprobs":[{"token":"<43>","logprob":-0.1143,"bytes":[60,52,51,62]},'
        b'{"token":"<947>","logprob":-3.3066,"bytes":[60,57,52,55,62]}]}]}'
    )
    none = chat_logprobs([42], 0, 0, key=7, vocab_size=VOCAB, decode=_decode)
    assert none.content is not None and none.content[0].top_logprobs == []


def test_bytes_are_utf8_and_a_tiny_vocabulary_still_works() -> None:
    logprobs = chat_logprobs(
        [0], 0, 5, key=1, vocab_size=2, decode=lambda ids: ["\u00e9"] * len(ids)
    )
    assert logprobs.content is not None
    assert logprobs.content[0].bytes == [195, 169]
    assert len(logprobs.content[0].top_logprobs) == 1


def test_tokens_named_by_id_as_vllms_return_tokens_as_token_ids() -> None:
    """The same values, every token named `token_id:{id}` (offsets advance by those names);
    a chat token's own `bytes` stay its text's, as vLLM takes them from `decoded_token`."""
    logprobs = completion_logprobs(
        [42, 43], 0, 1, key=7, vocab_size=VOCAB, decode=_decode, as_token_ids=True
    )
    assert ENCODE(logprobs) == (
        b'{"text_offset":[0,11],"token_logprobs":[-2.1472,-0.1143],'
        b'"tokens":["token_id:42","token_id:43"],'
        b'"top_logprobs":[{"token_id:42":-2.1472,"token_id:166":-0.3753},{"token_id:43":-0.1143}]}'
    )
    echoed = completion_logprobs(
        [5, 42],
        0,
        1,
        key=7,
        vocab_size=VOCAB,
        decode=_decode,
        first_is_none=True,
        as_token_ids=True,
    )
    assert (echoed.tokens, echoed.text_offset) == (["token_id:5", "token_id:42"], [0, 10])
    chat = chat_logprobs([42], 0, 2, key=7, vocab_size=VOCAB, decode=_decode, as_token_ids=True)
    assert ENCODE(chat) == (
        b'{"content":[{"token":"token_id:42","logprob":-2.1472,"bytes":[60,52,50,62],'
        b'"top_logprobs":[{"token":"token_id:42","logprob":-2.1472,'
        b'"bytes":[116,111,107,101,110,95,105,100,58,52,50]},'
        b'{"token":"token_id:166","logprob":-0.3753,'
        b'"bytes":[116,111,107,101,110,95,105,100,58,49,54,54]}]}]}'
    )
