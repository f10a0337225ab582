"""Pass timing: upstream polynomial constants, the fixed model, and Rust `Duration` rounding."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from engined.core.errors import InvalidArgsError
from engined.core.perf_model import (
    FixedPerfModel,
    PerfModel,
    PolynomialPerfModel,
    _duration_ns,
    make_perf_model,
    scale_ms,
)


def rust_from_secs_f64_ns(secs: float) -> int:
    """Exact reference: the float's rational value times 1e9, rounded half to even."""
    return round(Fraction(secs) * 10**9)


# --- polynomial -----------------------------------------------------------------------------


def test_fpm_single_prefill_request_vector() -> None:
    """docs/upstream/dynamo-mocker.md §5: bs 4, 16 blocks, prompt 8, speedup 0.

    Prefill T=8 -> 16.6229144639296 ms; decode p = 8/64 -> 12.0890625 ms; end ~28.71197696.
    """
    model = PolynomialPerfModel()
    prefill = model.prefill_ms(1, 8, 0)
    decode = model.decode_ms(1, 8, 8, 64)
    assert prefill == pytest.approx(16.6229144639296, abs=1e-12)
    assert decode == pytest.approx(12.0890625, abs=1e-12)
    total = scale_ms(prefill, 0.0) + scale_ms(decode, 0.0)
    assert total == pytest.approx(28.71197696, abs=1e-6)
    assert scale_ms(prefill, 0.0) == pytest.approx(16.622914, abs=1e-12)
    assert scale_ms(decode, 0.0) == pytest.approx(12.089063, abs=1e-12)


def test_polynomial_prefill_uses_batch_times_new_tokens() -> None:
    model = PolynomialPerfModel()
    t = 4 * (100 - 36)
    expected = 4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e01
    assert model.prefill_ms(4, 100, 36) == pytest.approx(expected, rel=1e-15)
    assert model.prefill_ms(4, 100, 36) == model.prefill_ms(1, t, 0)


@pytest.mark.parametrize(("batch", "isl", "prefix"), [(0, 10, 0), (1, 128, 128), (3, 5, 9)])
def test_polynomial_prefill_is_zero_without_new_tokens(batch: int, isl: int, prefix: int) -> None:
    assert PolynomialPerfModel().prefill_ms(batch, isl, prefix) == 0.0


def test_polynomial_decode_zero_batch_is_zero() -> None:
    assert PolynomialPerfModel().decode_ms(0, 100, 10, 64) == 0.0


def test_polynomial_decode_zero_capacity_uses_full_occupancy() -> None:
    assert PolynomialPerfModel().decode_ms(1, 8, 8, 0) == pytest.approx(-25.74 + 54.01 + 5.74)


def test_polynomial_decode_occupancy_is_not_clamped() -> None:
    """1.3.0 counts every held block, so p can exceed 1; upstream does not clamp it."""
    model = PolynomialPerfModel()
    assert model.decode_ms(1, 128, 8, 64) == pytest.approx(-25.74 * 4 + 54.01 * 2 + 5.74)
    assert model.decode_ms(1, 128, 8, 64) != model.decode_ms(1, 64, 8, 64)


def test_polynomial_decode_is_floored_at_one_ms() -> None:
    assert PolynomialPerfModel().decode_ms(1, 192, 8, 64) == 1.0


# --- fixed ----------------------------------------------------------------------------------


def test_fixed_model() -> None:
    model = FixedPerfModel(prefill_ms_per_token=0.5, pass_overhead_ms=2.0, decode_ms_per_pass=3.0)
    assert model.prefill_ms(2, 10, 4) == 2.0 + 0.5 * 2 * 6
    assert model.prefill_ms(0, 10, 4) == 0.0
    assert model.prefill_ms(2, 10, 10) == 0.0
    assert model.decode_ms(5, 1000, 200, 10) == 3.0
    assert model.decode_ms(0, 1000, 200, 10) == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_fixed_model_rejects_bad_values(bad: float) -> None:
    with pytest.raises(InvalidArgsError, match="decode_ms_per_pass"):
        FixedPerfModel(1.0, 1.0, bad)


def test_make_perf_model() -> None:
    assert isinstance(make_perf_model("polynomial"), PolynomialPerfModel)
    fixed = make_perf_model(
        "fixed", prefill_ms_per_token=1.0, pass_overhead_ms=0.0, decode_ms_per_pass=7.0
    )
    assert isinstance(fixed, FixedPerfModel)
    assert fixed.prefill_ms(1, 3, 0) == 3.0
    assert fixed.decode_ms(1, 0, 0, 0) == 7.0
    with pytest.raises(InvalidArgsError, match="unknown perf model kind 'npz'"):
        make_perf_model("npz")


def test_models_satisfy_protocol() -> None:
    models: list[PerfModel] = [PolynomialPerfModel(), FixedPerfModel(0.0, 0.0, 1.0)]
    assert [m.decode_ms(0, 0, 0, 0) for m in models] == [0.0, 0.0]


# --- Duration rounding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("secs", "ns"),
    [
        (0.0, 0),
        (1e-20, 0),
        (4.2e-7, 420),
        (2.7, 2_700_000_000),
        (3e10, 30_000_000_000 * 10**9),
        (5e-324, 0),
        (0.999e-9, 1),
        # Exact dyadic ties (x.5 ns): ties go to the even nanosecond.
        (1 / 1024, 976_562),
        (3 / 1024, 2_929_688),
    ],
)
def test_duration_rounding_matches_rust_doc_examples(secs: float, ns: int) -> None:
    assert _duration_ns(secs) == ns


def test_duration_rounding_matches_exact_reference() -> None:
    rng = random.Random(7)
    for _ in range(50_000):
        kind = rng.random()
        if kind < 0.4:
            secs = rng.random() * 10 ** rng.randint(-12, 9)
        elif kind < 0.7:
            secs = (rng.randint(0, 10**13) + 0.5) / 1e9
        else:
            secs = rng.randint(1, 2**20) * 2.0 ** rng.randint(-40, 12)
        assert _duration_ns(secs) == rust_from_secs_f64_ns(secs), secs


@pytest.mark.parametrize("bad", [-1e-9, math.nan, math.inf, 2.0**64])
def test_duration_rejects_what_rust_panics_on(bad: float) -> None:
    with pytest.raises(ValueError, match="cannot convert float seconds to Duration"):
        _duration_ns(bad)


def test_scale_ms_rounds_then_divides_like_div_f64() -> None:
    """Rust doc: Duration::new(2, 700_000_000).div_f64(3.14) == Duration::new(0, 859_872_611)."""
    assert scale_ms(2700.0, 3.14) == pytest.approx(859.872611, abs=1e-12)
    assert scale_ms(2700.0, 3.14e5) == pytest.approx(0.008599, abs=1e-15)


def test_scale_ms_without_positive_ratio_only_rounds() -> None:
    assert scale_ms(1.0000004, 0.0) == 1.0
    assert scale_ms(1.0000004, -5.0) == 1.0
    assert scale_ms(0.9765625, 0.0) == pytest.approx(0.976562, abs=1e-15)


def test_scale_ms_rounds_twice() -> None:
    """The raw time is rounded to ns before dividing, and the quotient is rounded again."""
    assert scale_ms(0.0000014, 1.0) == pytest.approx(1e-6, abs=1e-18)
    assert scale_ms(0.0000016, 2.0) == pytest.approx(1e-6, abs=1e-18)
    assert scale_ms(0.0000004, 0.5) == 0.0


def test_scale_ms_zero_is_zero() -> None:
    assert scale_ms(0.0, 10.0) == 0.0
