"""Which ids an unplanned generated token may take (`vocab_size`, `excluded_token_ids`).

Unset, a token is a raw u32 (`getrandbits(32)`), as it always was: every seed twin keeps its
numbers. A client that detokenizes (a Dynamo frontend) needs ids its tokenizer knows, and
needs the model's EOS and special tokens never to appear, or a stream would stop early or
print control text; hence a vocabulary, drawn from each request's own stream
(engined/core/token_stream.py) so one seed still gives one output.

The draw is exact (uniform, no modulo bias) and cheap: rejection over `[0, 2**bits)` with
a set test for the excluded ids costs fewer than two RNG calls on average while at least
half the vocabulary is drawable. When most of it is excluded, a table of the drawable ids
(smaller than the excluded tuple itself) keeps it at one draw plus a lookup.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable

from engined.core.token_stream import TokenBits

VOCAB_SIZE_MAX = 2**32
# The most excluded ids a vocabulary may name. Real tokenizers' EOS and special tokens number
# from a few dozen (Qwen2.5: 22) through 256 (Llama 3's reserved block) and 1,000 (Mistral's
# Tekken control tokens) to about 6,400 (Gemma 3: 6,242 `<unusedN>` and the rest); twice the
# largest power of two below that leaves room. The bound keeps what the ids cost everywhere
# they are kept or sent bounded: the cores' sets, and every `welcome` (41 KB at most for them).
EXCLUDED_TOKEN_IDS_MAX = 8192


def vocabulary_error(vocab_size: int | None, excluded_token_ids: Iterable[int]) -> str | None:
    """The first broken rule of a vocabulary setting, naming the field, or None when valid.

    One function serves `EngineArgs` and the `SetVocabulary` command, so a setting refused
    at start-up is refused at run time with the same words.
    """
    problem = vocabulary_problem(vocab_size, excluded_token_ids)
    return None if problem is None else problem[1]


def vocabulary_problem(
    vocab_size: int | None, excluded_token_ids: Iterable[int]
) -> tuple[str, str] | None:
    """`vocabulary_error` with the field it is about: (key, message), for `EngineArgs`."""
    excluded = list(excluded_token_ids)
    if len(excluded) > EXCLUDED_TOKEN_IDS_MAX:
        return "excluded_token_ids", (
            f"excluded_token_ids has {len(excluded)} ids, more than the {EXCLUDED_TOKEN_IDS_MAX} "
            "allowed (a model's EOS and special tokens are far fewer)"
        )
    if vocab_size is not None and not 1 <= vocab_size <= VOCAB_SIZE_MAX:
        return "vocab_size", f"vocab_size must be in [1, {VOCAB_SIZE_MAX}], got {vocab_size}"
    for index, token_id in enumerate(excluded):
        if token_id < 0:
            return "excluded_token_ids", f"excluded_token_ids[{index}] must be >= 0, got {token_id}"
        if vocab_size is not None and token_id >= vocab_size:
            return "excluded_token_ids", (
                f"excluded_token_ids[{index}] must be < vocab_size ({vocab_size}), got {token_id}"
            )
        if token_id >= VOCAB_SIZE_MAX:
            return "excluded_token_ids", (
                f"excluded_token_ids[{index}] must be < {VOCAB_SIZE_MAX} (token ids are u32), "
                f"got {token_id}"
            )
    if vocab_size is not None and len(set(excluded)) >= vocab_size:
        return "excluded_token_ids", (
            f"excluded_token_ids leave none of the {vocab_size} ids of vocab_size drawable; "
            "at least one must remain"
        )
    return None


def canonical_excluded(excluded_token_ids: Iterable[int]) -> tuple[int, ...]:
    """Sorted and without repeats: equal settings compare equal and print the same."""
    return tuple(sorted(set(excluded_token_ids)))


class Vocabulary:
    """The token range of one core, read by every unplanned draw.

    Sequences hold the core's instance, so `configure` (the `SetVocabulary` command) applies
    to every token drawn after it, in running requests too. `draw` takes the drawing request's
    `getrandbits`; it is None while the range is the raw u32 one: callers then inline
    `getrandbits(32)`, which keeps the default path as fast as before the option existed.
    """

    __slots__ = ("_skip", "draw", "excluded_token_ids", "vocab_size")

    def __init__(
        self, vocab_size: int | None = None, excluded_token_ids: Iterable[int] = ()
    ) -> None:
        self.vocab_size: int | None = None
        self.excluded_token_ids: tuple[int, ...] = ()
        self._skip: frozenset[int] = frozenset()
        self.draw: Callable[[TokenBits], int] | None = None
        self.configure(vocab_size, excluded_token_ids)

    def configure(self, vocab_size: int | None, excluded_token_ids: Iterable[int]) -> None:
        """Switch the range; the caller has validated it (`vocabulary_error`)."""
        excluded = canonical_excluded(excluded_token_ids)
        self.vocab_size = vocab_size
        self.excluded_token_ids = excluded
        self._skip = frozenset(excluded)
        self.draw = _make_draw(vocab_size, excluded)

    def next_token(self, getrandbits: TokenBits) -> int:
        """One unplanned token id drawn with `getrandbits` (the non-inlined path)."""
        draw = self.draw
        return getrandbits(32) if draw is None else draw(getrandbits)

    def num_drawable(self) -> int:
        """How many ids an unplanned draw may yield."""
        size = VOCAB_SIZE_MAX if self.vocab_size is None else self.vocab_size
        return size - len(self.excluded_token_ids)

    def allows(self, token: int) -> bool:
        """Whether the range in force may yield `token` (one drawn before a change may not)."""
        size = self.vocab_size
        return (size is None or token < size) and token not in self._skip


def _make_draw(
    vocab_size: int | None, excluded: tuple[int, ...]
) -> Callable[[TokenBits], int] | None:
    if vocab_size is None:
        if not excluded:
            return None
        vocab_size = VOCAB_SIZE_MAX
    drawable = vocab_size - len(excluded)
    if 2 * drawable < vocab_size:
        return _table_draw(vocab_size, frozenset(excluded))
    bits = (vocab_size - 1).bit_length()
    if not excluded:

        def draw_range(getrandbits: TokenBits) -> int:
            token = getrandbits(bits)
            while token >= vocab_size:
                token = getrandbits(bits)
            return token

        return draw_range
    skip = frozenset(excluded)

    def draw_rejecting(getrandbits: TokenBits) -> int:
        token = getrandbits(bits)
        while token >= vocab_size or token in skip:
            token = getrandbits(bits)
        return token

    return draw_rejecting


def _table_draw(vocab_size: int, skip: frozenset[int]) -> Callable[[TokenBits], int]:
    """Most ids excluded: index a table of the few drawable ones instead of rejecting."""
    # NOTE: fewer drawable ids than excluded ones, so the table is smaller than the setting.
    table = array("I", (token for token in range(vocab_size) if token not in skip))
    count = len(table)
    bits = (count - 1).bit_length()

    def draw_table(getrandbits: TokenBits) -> int:
        index = getrandbits(bits)
        while index >= count:
            index = getrandbits(bits)
        return table[index]

    return draw_table
