"""MTP burst sampling (docs/upstream/dynamo-mocker.md §4.5; upstream `speculative.rs` tests)."""

from __future__ import annotations

import random

import pytest

from engined.core.errors import InvalidArgsError
from engined.core.speculative import SpeculativeSampler


def test_zero_remaining_emits_nothing() -> None:
    assert SpeculativeSampler([1.0, 1.0], seed=0).sample_output_tokens(0) == 0


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([], 1),
        ([1.0], 2),
        ([1.0, 1.0], 3),
        ([0.0, 1.0], 1),
        ([1.0, 0.0, 1.0], 2),
        ([1.0, 1.0, 1.0, 1.0, 1.0], 6),
    ],
)
def test_deterministic_rates(rates: list[float], expected: int) -> None:
    for seed in (0, 42, 2**64 - 1):
        sampler = SpeculativeSampler(rates, seed=seed)
        assert [sampler.sample_output_tokens(100) for _ in range(50)] == [expected] * 50


def test_burst_is_capped_by_remaining() -> None:
    sampler = SpeculativeSampler([1.0, 1.0, 1.0], seed=1)
    assert [sampler.sample_output_tokens(r) for r in (1, 2, 3, 4, 5)] == [1, 2, 3, 4, 4]


def test_equal_seeds_give_equal_streams() -> None:
    a = SpeculativeSampler([0.6, 0.5, 0.4], seed=42)
    b = SpeculativeSampler([0.6, 0.5, 0.4], seed=42)
    assert [a.sample_output_tokens(10) for _ in range(1000)] == [
        b.sample_output_tokens(10) for _ in range(1000)
    ]


def test_different_seeds_differ() -> None:
    a = SpeculativeSampler([0.6, 0.5, 0.4], seed=42)
    b = SpeculativeSampler([0.6, 0.5, 0.4], seed=43)
    assert [a.sample_output_tokens(10) for _ in range(1000)] != [
        b.sample_output_tokens(10) for _ in range(1000)
    ]


def test_mean_burst_matches_acceptance_rates() -> None:
    """E[burst] = 1 + r1 + r1*r2 for rates [r1, r2] when `remaining` never caps it."""
    sampler = SpeculativeSampler([0.85, 0.3], seed=42)
    n = 200_000
    mean = sum(sampler.sample_output_tokens(1_000) for _ in range(n)) / n
    assert mean == pytest.approx(1 + 0.85 + 0.85 * 0.3, abs=0.01)


def test_sampler_does_not_touch_global_random() -> None:
    random.seed(5)
    expected = random.random()
    random.seed(5)
    SpeculativeSampler([0.5, 0.5], seed=3).sample_output_tokens(10)
    assert random.random() == expected


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_rejects_rates_outside_unit_interval(rate: float) -> None:
    with pytest.raises(InvalidArgsError, match="MTP acceptance rate"):
        SpeculativeSampler([0.5, rate], seed=0)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_rejects_seeds_outside_u64(seed: int) -> None:
    with pytest.raises(InvalidArgsError, match="MTP seed must be a u64"):
        SpeculativeSampler([0.5], seed=seed)


def test_rates_are_exposed_as_tuple() -> None:
    assert SpeculativeSampler([1, 0.5], seed=0).rates == (1.0, 0.5)
