"""Stop strings as vLLM applies them: cut, held back while they may still match, tokens after
the stop not counted."""

from __future__ import annotations

from collections.abc import Sequence

from engined.openai.text import ChoiceText


class Words:
    """Token t decodes to the t-th word of `words` (a fake incremental detokenizer)."""

    def __init__(self, words: Sequence[str]) -> None:
        self.words = words

    def push(self, new_ids: Sequence[int]) -> str:
        return "".join(self.words[i] for i in new_ids)


WORDS = (" the", " cat", " sat", " on", " a", " mat", "b")


def test_without_stop_strings_text_passes_through() -> None:
    text = ChoiceText(Words(WORDS))
    assert text.push([0, 1], final=False) == (" the cat", 2)
    assert text.push([2], final=True) == (" sat", 1)
    assert text.stopped is None


def test_stop_string_cuts_the_text_and_the_tokens_after_it() -> None:
    text = ChoiceText(Words(WORDS), stop=(" sat",))
    assert text.push([0, 1, 2, 3, 4], final=False) == (" the cat", 3)
    assert text.stopped == " sat"
    assert text.push([5], final=False) == ("", 0)


def test_include_stop_str_in_output_keeps_it() -> None:
    text = ChoiceText(Words(WORDS), stop=(" sat",), include_stop=True)
    assert text.push([0, 1, 2, 3], final=False) == (" the cat sat", 3)


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    """The last len(stop) - 1 characters wait, as vLLM's detokenizer holds them, until
    the next token shows they do not start `" ab"`; the final push sends them."""
    text = ChoiceText(Words(WORDS), stop=(" ab",))
    assert text.push([0, 4], final=False) == (" the", 2)
    assert text.push([5], final=False) == (" a m", 1)
    assert text.push([], final=True) == ("at", 0)


def test_a_stop_string_split_over_two_deltas_matches() -> None:
    text = ChoiceText(Words(WORDS), stop=(" ab",))
    assert text.push([0, 4], final=False) == (" the", 2)
    assert text.push([6, 1], final=False) == ("", 1)
    assert text.stopped == " ab"


def test_the_earliest_stop_string_wins() -> None:
    text = ChoiceText(Words(WORDS), stop=(" mat", " cat"))
    assert text.push([0, 1, 2, 3, 4, 5], final=True) == (" the", 2)
    assert text.stopped == " cat"
