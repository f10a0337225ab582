"""A request's generated tokens depend only on the engine seed, the request and the position.

Each test runs the same requests in different ways (alone, batched, submitted at other passes,
among other requests, preempted by a small pool, in MTP bursts, split by a P/D handoff) and
compares every request's tokens with those it gets alone on an engine of the same settings.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, Semantics, WorkerType
from engined.core.engine import Engine
from engined.core.errors import InvalidRequestError
from engined.core.sequence import Sequence
from engined.core.token_stream import SEED_MAX, SEED_MIN, token_bits
from engined.core.types import (
    APPLIED,
    ActivateDestination,
    Request,
    ReserveDestination,
    SetVocabulary,
    Submit,
    SubmitHandoffPrefill,
)
from engined.core.vocab import Vocabulary
from tests.core.factories import command, make_args, make_core, submit


def seeded(request_id: str, prompt: list[int], max_tokens: int, seed: int | None) -> Request:
    return Request(token_ids=prompt, max_tokens=max_tokens, request_id=request_id, seed=seed)


def drain(core: Engine, arrivals: dict[int, list[Request]] | None = None) -> dict[str, list[int]]:
    """Run `core` to empty, submitting `arrivals[k]` before pass k; tokens per request."""
    arrivals = dict(arrivals or {})
    tokens: dict[str, list[int]] = {}
    now = 0.0
    for index in range(20_000):
        for req in arrivals.pop(index, []):
            submit(core, req, now)
        if not arrivals and core.is_empty():
            return tokens
        result = core.execute_pass(now)
        now = max(now, result.end_ms)
        for out in result.request_outputs():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("core did not drain")


def alone(args: EngineArgs, req: Request) -> list[int]:
    core = make_core(args)
    submit(core, req)
    return drain(core).get(str(req.request_id), [])


# --- exact values: the rule is a contract -----------------------------------------------------


def test_stream_values_are_pinned() -> None:
    """Seed 0, request "a", prompt [1, 2, 3]: the first tokens, unseeded and with seed 42."""
    assert alone(make_args(), seeded("a", [1, 2, 3], 3, None)) == [
        29204807,
        1805598779,
        916115983,
    ]
    assert alone(make_args(), seeded("a", [1, 2, 3], 3, 42)) == [
        4108566122,
        2374844428,
        2213851913,
    ]


# --- batching, timing, interleaving, preemption ------------------------------------------------


def test_forced_preemptions_do_not_change_any_token() -> None:
    """Six requests of 8 + 16 tokens in 8 blocks of 4: they preempt each other many times."""
    args = make_args(num_gpu_blocks=8, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = [seeded(f"r{n}", list(range(n, n + 8)), 16, None) for n in range(6)]
    core = make_core(args)
    together = drain(core, {0: reqs})
    assert core.metrics().preemptions_total >= 6
    assert together == {str(r.request_id): alone(args, r) for r in reqs}
    assert all(len(tokens) == 16 for tokens in together.values())


workloads = st.fixed_dictionaries(
    {
        "caching": st.booleans(),
        "blocks": st.integers(10, 40),
        "budget": st.integers(4, 40),
        "seqs": st.integers(1, 5),
        "vocab": st.sampled_from([None, (50, (0, 1, 2)), (3, (1,))]),
        "requests": st.lists(
            st.tuples(
                st.integers(1, 14),  # prompt length
                st.integers(0, 20),  # max tokens
                st.integers(0, 12),  # submit pass
                st.sampled_from([None, 7, -1]),  # request seed
            ),
            min_size=1,
            max_size=8,
        ),
        "others": st.lists(st.tuples(st.integers(1, 14), st.integers(0, 12)), max_size=4),
        "semantics": st.sampled_from(list(Semantics)),
    }
)


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_tokens_do_not_depend_on_batching_timing_or_other_requests(w: dict[str, Any]) -> None:
    vocab: dict[str, Any] = {}
    if w["vocab"] is not None:
        vocab = {"vocab_size": w["vocab"][0], "excluded_token_ids": w["vocab"][1]}
    args = make_args(
        enable_prefix_caching=w["caching"],
        num_gpu_blocks=w["blocks"],
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["seqs"],
        semantics=w["semantics"],
        **vocab,
    )
    mine = [
        seeded(f"q{n}", [n % 3] * length, out, seed)
        for n, (length, out, _, seed) in enumerate(w["requests"])
    ]
    arrivals: dict[int, list[Request]] = {}
    for req, (_, _, at, _) in zip(mine, w["requests"], strict=True):
        arrivals.setdefault(at, []).append(req)
    for n, (length, at) in enumerate(w["others"]):
        arrivals.setdefault(at, []).append(seeded(f"other{n}", [9] * length, 12, None))
    mixed = drain(make_core(args), arrivals)
    for req in mine:
        assert mixed.get(str(req.request_id), []) == alone(args, req)


def test_mtp_bursts_emit_the_tokens_single_steps_emit() -> None:
    """Rejected drafts are never drawn: bursts of 1 to 3 tokens give the plain decode's tokens."""
    plain = make_args(num_gpu_blocks=40, max_num_batched_tokens=32)
    mtp = make_args(
        num_gpu_blocks=40, max_num_batched_tokens=32, aic_nextn=2, aic_nextn_accept_rates="0.6,0.5"
    )
    reqs = [seeded(f"m{n}", list(range(n, n + 5)), 30, None) for n in range(3)]
    bursts = drain(make_core(mtp), {0: reqs})
    assert bursts == {str(r.request_id): alone(plain, r) for r in reqs}


# --- request seeds ----------------------------------------------------------------------------


def test_a_request_seed_gives_the_same_tokens_whatever_the_id_and_engine_seed() -> None:
    prompt = [5, 6, 7, 8, 9]
    first = alone(make_args(), seeded("a", prompt, 12, 1234))
    assert alone(make_args(seed=99), seeded("zzz", prompt, 12, 1234)) == first
    assert alone(make_args(), seeded("a", prompt, 12, 1235)) != first
    assert alone(make_args(), seeded("a", [5, 6, 7, 8, 10], 12, 1234)) != first
    assert alone(make_args(), seeded("a", prompt, 12, None)) != first


def test_seed_minus_one_is_no_seed_as_in_vllm() -> None:
    prompt = [1, 2, 3, 4]
    assert alone(make_args(), seeded("a", prompt, 6, -1)) == alone(
        make_args(), seeded("a", prompt, 6, None)
    )


def test_without_a_seed_the_engine_seed_and_id_key_the_tokens() -> None:
    prompt = [1, 2, 3, 4]
    first = alone(make_args(seed=3), seeded("a", prompt, 6, None))
    assert alone(make_args(seed=3), seeded("a", [7, 7], 6, None)) == first
    assert alone(make_args(seed=4), seeded("a", prompt, 6, None)) != first
    assert alone(make_args(seed=3), seeded("b", prompt, 6, None)) != first


@pytest.mark.parametrize("seed", [SEED_MIN - 1, SEED_MAX + 1, 2**200])
def test_a_seed_outside_int64_is_refused_naming_the_field(seed: int) -> None:
    core = make_core()
    with pytest.raises(InvalidRequestError) as refused:
        core.apply(Submit(seeded("a", [1, 2], 2, seed)), now_ms=0.0)
    assert str(refused.value) == (
        "request.seed must be in [-9223372036854775808, 9223372036854775807] (vLLM's int64), "
        f"got {seed}"
    )
    assert core.is_empty()


@pytest.mark.parametrize("seed", [SEED_MIN, SEED_MAX])
def test_the_int64_bounds_are_seeds(seed: int) -> None:
    assert len(alone(make_args(), seeded("a", [1, 2], 3, seed))) == 3


# --- a token taken back keeps its position ------------------------------------------------------


def _sequence_at_block_end(vocab: Vocabulary) -> Sequence:
    return Sequence(
        [1, 2, 3, 4],
        3,
        4,
        caching=True,
        rng=random.Random(0),
        token_bits=token_bits(0, "s", None, [1, 2, 3, 4]),
        next_partial_id=itertools.count().__next__,
        vocab=vocab,
    )


def test_a_popped_token_is_the_retry() -> None:
    seq = _sequence_at_block_end(Vocabulary(1000))
    first = seq.generate_token().token
    seq.pop()
    assert seq.generate_token().token == first
    assert list(seq.tokens) == [1, 2, 3, 4, first]


def test_a_popped_token_the_new_vocabulary_excludes_is_drawn_again() -> None:
    vocab = Vocabulary(1000)
    seq = _sequence_at_block_end(vocab)
    first = seq.generate_token().token
    seq.pop()
    vocab.configure(1000, (first,))
    retry = seq.generate_token().token
    assert retry != first and 0 <= retry < 1000


# --- P/D handoff --------------------------------------------------------------------------------


def test_the_decode_side_continues_the_sequence_the_prefill_side_started() -> None:
    """Same --seed, same request id: the prefill's token is the aggregated request's first,
    and the decode side emits the aggregated request's tokens."""
    base: dict[str, Any] = {
        "num_gpu_blocks": 20,
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        "seed": 5,
    }
    prompt = list(range(10))
    aggregated = alone(make_args(**base), seeded("ctx-1", prompt, 8, None))

    prefill = make_core(make_args(**base, worker_type=WorkerType.PREFILL))
    command(prefill, SubmitHandoffPrefill("h", seeded("ctx-1", prompt, 1, None)))
    assert drain(prefill) == {"ctx-1": aggregated[:1]}

    decode = make_core(make_args(**base, worker_type=WorkerType.DECODE))
    command(decode, ReserveDestination("h", seeded("ctx-1", prompt, 8, None)))
    assert command(decode, ActivateDestination("h")) is APPLIED
    assert drain(decode) == {"ctx-1": aggregated}


def test_a_vocabulary_keeps_every_token_in_range_across_batching() -> None:
    args = make_args(num_gpu_blocks=12, max_num_batched_tokens=8, vocab_size=5)
    reqs = [seeded(f"v{n}", [n, n + 1, n + 2], 10, None) for n in range(4)]
    core = make_core(args)
    assert command(core, SetVocabulary(5, (4,))) is APPLIED
    together = drain(core, {0: reqs[:2], 3: reqs[2:]})
    expected_args = make_args(
        num_gpu_blocks=12, max_num_batched_tokens=8, vocab_size=5, excluded_token_ids=(4,)
    )
    assert together == {str(r.request_id): alone(expected_args, r) for r in reqs}
    assert {t for tokens in together.values() for t in tokens} <= {0, 1, 2, 3}
