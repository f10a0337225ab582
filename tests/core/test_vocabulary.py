"""Generated ids a tokenizer can decode: `vocab_size`, `excluded_token_ids`, `SetVocabulary`."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from engined.core.args import EngineArgs
from engined.core.engine import Engine
from engined.core.errors import InvalidArgsError, InvalidRequestError
from engined.core.token_stream import token_bits
from engined.core.types import APPLIED, SetVocabulary
from engined.core.vocab import (
    EXCLUDED_TOKEN_IDS_MAX,
    VOCAB_SIZE_MAX,
    Vocabulary,
    vocabulary_error,
)
from tests.core.factories import (
    command,
    make_args,
    make_core,
    request,
    router_args,
    submit,
    tokens_of,
    uid,
)


def outputs(core: Engine) -> dict[str, list[int]]:
    """Run `core` dry; every request's emitted token ids, in order."""
    tokens: dict[str, list[int]] = {}
    now = 0.0
    for _ in range(10_000):
        if core.is_empty():
            return tokens
        result = core.execute_pass(now)
        now = max(now, result.end_ms)
        for out in result.request_outputs():
            if out.new_token_ids:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("core did not drain")


def run(args: EngineArgs, prompts: int = 3, max_tokens: int = 40) -> dict[str, list[int]]:
    core = make_core(args)
    for n in range(prompts):
        submit(core, request(uid(n), range(n, n + 6), max_tokens))
    return outputs(core)


def vocab_args(**overrides: Any) -> EngineArgs:
    """Room for three requests of 46 tokens (bs 4), with and without prefix caching."""
    fields: dict[str, Any] = {"num_gpu_blocks": 64, "max_num_batched_tokens": 64}
    fields.update(overrides)
    return make_args(**fields)


# --- unset: raw u32 ids, exactly as before -----------------------------------------------------


def test_unset_vocabulary_draws_the_raw_u32_stream() -> None:
    """The outputs are the u32s of the request's own stream, in order."""
    core = make_core(router_args(seed=7))
    submit(core, request("a", [1, 2, 3], 10))
    bits = token_bits(7, "a", None, [1, 2, 3])
    assert outputs(core) == {"a": [bits(32) for _ in range(10)]}


# --- vocab_size and excluded_token_ids ------------------------------------------------------------


@pytest.mark.parametrize("caching", [False, True])
def test_ids_stay_below_vocab_size(caching: bool) -> None:
    tokens = run(vocab_args(vocab_size=50, enable_prefix_caching=caching))
    drawn = [t for stream in tokens.values() for t in stream]
    assert len(drawn) == 3 * 40
    assert all(0 <= t < 50 for t in drawn)
    assert len(set(drawn)) > 25  # uniform over 50 ids: 120 draws cover most of them


def test_exclusion_is_exact_and_keeps_max_tokens() -> None:
    tokens = run(vocab_args(vocab_size=4, excluded_token_ids=(0, 1, 2)))
    assert tokens == {uid(n): [3] * 40 for n in range(3)}


@pytest.mark.parametrize(
    ("vocab_size", "excluded"),
    [(10, (0, 1, 2, 3, 4, 5, 6)), (1000, (0, 999, 500)), (2, (1,)), (7, ())],
)
def test_every_drawable_id_and_nothing_else_appears(
    vocab_size: int, excluded: tuple[int, ...]
) -> None:
    """Both draw strategies (rejection, table of the few drawable ids) hit exactly the range."""
    vocab = Vocabulary(vocab_size, excluded)
    bits = random.Random(3).getrandbits
    drawn = {vocab.next_token(bits) for _ in range(20_000)}
    allowed = set(range(vocab_size)) - set(excluded)
    assert drawn <= allowed
    if len(allowed) <= 100:
        assert drawn == allowed


def test_exclusion_without_vocab_size_skips_the_excluded_u32s() -> None:
    values = iter([5, 9, 5, 2**32 - 1, 7])

    def scripted(k: int) -> int:
        assert k == 32
        return next(values)

    vocab = Vocabulary(None, (5, 2**32 - 1))
    assert [vocab.next_token(scripted) for _ in range(2)] == [9, 7]


def test_same_seed_same_outputs_other_seed_other_outputs() -> None:
    first = run(vocab_args(vocab_size=1000, excluded_token_ids=(0, 1), seed=11))
    assert run(vocab_args(vocab_size=1000, excluded_token_ids=(0, 1), seed=11)) == first
    assert run(vocab_args(vocab_size=1000, excluded_token_ids=(0, 1), seed=12)) != first


def test_planned_outputs_are_emitted_as_given() -> None:
    core = make_core(vocab_args(vocab_size=4, excluded_token_ids=(0, 1, 2)))
    submit(core, request("p", [1, 2, 3], 0, output_token_ids=[0, 1, 2, 99, 2**32 - 1]))
    submit(core, request("r", [1, 2, 3], 5))
    assert outputs(core) == {"p": [0, 1, 2, 99, 2**32 - 1], "r": [3] * 5}


def test_mtp_bursts_draw_from_the_vocabulary() -> None:
    args = vocab_args(
        vocab_size=5, excluded_token_ids=(0, 4), aic_nextn=2, aic_nextn_accept_rates="1,1"
    )
    tokens = run(args, max_tokens=30)
    assert all(len(stream) == 30 and set(stream) <= {1, 2, 3} for stream in tokens.values())


# --- SetVocabulary ------------------------------------------------------------------------------


def test_set_vocabulary_applies_to_tokens_drawn_after_it() -> None:
    core = make_core(vocab_args())
    submit(core, request("a", [1, 2, 3], 12))
    before: list[int] = []
    while len(before) < 4:
        before += tokens_of(core.execute_pass(0.0), "a")
    assert command(core, SetVocabulary(4, (0, 1, 2))) is APPLIED
    after = outputs(core)["a"]
    assert len(before) + len(after) == 12
    assert any(t >= 4 for t in before) and after == [3] * len(after)


def test_set_vocabulary_none_restores_raw_ids() -> None:
    core = make_core(vocab_args(vocab_size=3))
    assert command(core, SetVocabulary(None, ())) is APPLIED
    submit(core, request("a", [1, 2, 3], 20))
    assert any(t >= 3 for t in outputs(core)["a"])


def test_set_vocabulary_is_deterministic() -> None:
    def once() -> dict[str, list[int]]:
        core = make_core(vocab_args(seed=5))
        submit(core, request("a", [1, 2, 3], 10))
        core.execute_pass(0.0)
        command(core, SetVocabulary(100, (7,)))
        return outputs(core)

    assert once() == once()


@pytest.mark.parametrize(
    ("refused", "message"),
    [
        (SetVocabulary(0, ()), "vocab_size must be in [1, 4294967296], got 0"),
        (SetVocabulary(2**32 + 1, ()), "vocab_size must be in [1, 4294967296], got 4294967297"),
        (SetVocabulary(10, (3, -1)), "excluded_token_ids[1] must be >= 0, got -1"),
        (SetVocabulary(10, (10,)), "excluded_token_ids[0] must be < vocab_size (10), got 10"),
        (SetVocabulary(None, (2**32,)), "excluded_token_ids[0] must be < 4294967296"),
        (
            SetVocabulary(3, (0, 1, 2, 2)),
            "excluded_token_ids leave none of the 3 ids of vocab_size drawable",
        ),
        (
            SetVocabulary(None, tuple(range(EXCLUDED_TOKEN_IDS_MAX + 1))),
            "excluded_token_ids has 8193 ids, more than the 8192 allowed",
        ),
        (
            # Counted as sent: repeats cost as much to carry as distinct ids.
            SetVocabulary(10, (5,) * (EXCLUDED_TOKEN_IDS_MAX + 1)),
            "excluded_token_ids has 8193 ids, more than the 8192 allowed",
        ),
    ],
)
def test_set_vocabulary_refusals_change_nothing(refused: SetVocabulary, message: str) -> None:
    core = make_core(vocab_args(vocab_size=4, excluded_token_ids=(0, 1, 2)))
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        command(core, refused)
    submit(core, request("a", [1, 2, 3], 6))
    assert outputs(core) == {"a": [3] * 6}


# --- EngineArgs ---------------------------------------------------------------------------------


def test_args_default_to_raw_ids() -> None:
    args = EngineArgs.from_mapping({})
    assert (args.vocab_size, args.excluded_token_ids) == (None, ())


def test_args_canonicalise_excluded_ids() -> None:
    args = EngineArgs.from_mapping({"vocab_size": 10, "excluded_token_ids": [5, 1, 5]})
    assert args.excluded_token_ids == (1, 5)
    assert args.normalized() == args


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"vocab_size": 0}, "vocab_size must be in [1, 4294967296], got 0"),
        ({"vocab_size": VOCAB_SIZE_MAX + 1}, "vocab_size must be in [1, 4294967296]"),
        ({"excluded_token_ids": [-2]}, "excluded_token_ids[0] must be >= 0, got -2"),
        (
            {"vocab_size": 8, "excluded_token_ids": [1, 8]},
            "excluded_token_ids[1] must be < vocab_size (8), got 8",
        ),
        (
            {"vocab_size": 1, "excluded_token_ids": [0]},
            "excluded_token_ids leave none of the 1 ids of vocab_size drawable",
        ),
        (
            {"excluded_token_ids": list(range(EXCLUDED_TOKEN_IDS_MAX + 1))},
            "excluded_token_ids has 8193 ids, more than the 8192 allowed (a model's EOS and "
            "special tokens are far fewer)",
        ),
        ({"excluded_token_ids": None}, "excluded_token_ids must not be null"),
        ({"excluded_token_ids": "1,2"}, "Expected `array`, got `str` - at `$.excluded_token_ids`"),
        ({"vocab_size": 1.5}, "Expected `int | null`, got `float` - at `$.vocab_size`"),
    ],
)
def test_args_refuse_bad_vocabularies(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgsError, match=re.escape(message)):
        EngineArgs.from_mapping(data)


def test_vocabulary_error_accepts_the_edges() -> None:
    assert vocabulary_error(1, ()) is None
    assert vocabulary_error(None, range(EXCLUDED_TOKEN_IDS_MAX)) is None
    assert vocabulary_error(EXCLUDED_TOKEN_IDS_MAX + 1, range(EXCLUDED_TOKEN_IDS_MAX)) is None
    assert vocabulary_error(VOCAB_SIZE_MAX, (0, VOCAB_SIZE_MAX - 1)) is None
    assert vocabulary_error(None, (0, VOCAB_SIZE_MAX - 1)) is None
    assert vocabulary_error(2, (1,)) is None
