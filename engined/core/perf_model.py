"""Modeled duration of one engine pass, in milliseconds.

The core asks twice per pass (prefill of the pass's chunks, then decode of the ready batch) and
adds the results to `now_ms`. Everything is modelled time: the pacing against the wall
(`speedup_ratio`) is the server's (engined.model_clock), never the core's. Models return the raw
time; `scale_ms` rounds it to a Rust `Duration` (and applies decode's own `decode_speedup_ratio`),
so pass end times match upstream's modelled durations to the nanosecond and two requests
finishing in one pass get bit-identical timestamps.

Everything here runs once per pass per rank, so the functions do plain float arithmetic and
allocate nothing beyond the floats they return.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

from engined.core.errors import InvalidArgsError

PerfModelKind = Literal["polynomial", "fixed"]

_NS_PER_S = 1_000_000_000
_NS_PER_S_F = 1e9
_MAX_DURATION_SECS = 2.0**64
# Twice the relative error bound of one float multiplication (2**-53), for headroom.
_TIE_MARGIN = 2.0**-52

# Upstream `PerfModel::Polynomial` (dynamo-mocker 1.3.0, common/perf_model.rs).
_PREFILL_A = 4.209989e-07
_PREFILL_B = 1.518344e-02
_PREFILL_C = 1.650142e01
_DECODE_A = -25.74
_DECODE_B = 54.01
_DECODE_C = 5.74
_DECODE_FLOOR_MS = 1.0


class PerfModel(Protocol):
    """What the core needs from a timing model: raw modelled milliseconds, before rounding."""

    def prefill_ms(self, batch: int, mean_isl: int, mean_prefix: int) -> float:
        """Time of one prefill pass over `batch` chunks of integer-mean shape."""
        ...

    def decode_ms(
        self, batch: int, active_kv_tokens: int, context_length: int, total_kv_tokens: int
    ) -> float:
        """Time of one decode forward over `batch` ready requests."""
        ...


class PolynomialPerfModel:
    """Upstream's default fit: prefill quadratic in batch tokens, decode in KV occupancy.

    The decode occupancy `active / total` is deliberately not clamped (1.3.0 counts every held
    block, which can exceed the pool's nominal size with holds and reservations), and the
    result is floored at 1 ms so token-emitting passes never collapse onto one timestamp.
    Products are written `t * t` because Rust's `powi(2)` compiles to that exact product.
    """

    __slots__ = ()

    def prefill_ms(self, batch: int, mean_isl: int, mean_prefix: int) -> float:
        new = mean_isl - mean_prefix
        if batch == 0 or new <= 0:
            return 0.0
        t = float(batch * new)
        ms = _PREFILL_A * (t * t) + _PREFILL_B * t + _PREFILL_C
        return ms if ms > 0.0 else 0.0

    def decode_ms(
        self, batch: int, active_kv_tokens: int, context_length: int, total_kv_tokens: int
    ) -> float:
        if batch == 0:
            return 0.0
        p = active_kv_tokens / total_kv_tokens if total_kv_tokens > 0 else 1.0
        ms = _DECODE_A * (p * p) + _DECODE_B * p + _DECODE_C
        return ms if ms > _DECODE_FLOOR_MS else _DECODE_FLOOR_MS


class FixedPerfModel:
    """Affine timing for tests and benchmarks that need round, predictable pass lengths.

    Not an upstream model. Prefill charges a per-pass overhead plus a cost per new token of
    the batch; decode charges a constant per forward, independent of batch size and KV load.
    """

    __slots__ = ("decode_ms_per_pass", "pass_overhead_ms", "prefill_ms_per_token")

    def __init__(
        self, prefill_ms_per_token: float, pass_overhead_ms: float, decode_ms_per_pass: float
    ) -> None:
        for name, value in (
            ("prefill_ms_per_token", prefill_ms_per_token),
            ("pass_overhead_ms", pass_overhead_ms),
            ("decode_ms_per_pass", decode_ms_per_pass),
        ):
            if not (math.isfinite(value) and value >= 0.0):
                raise InvalidArgsError(f"{name} must be a finite number >= 0, got {value}")
        self.prefill_ms_per_token = float(prefill_ms_per_token)
        self.pass_overhead_ms = float(pass_overhead_ms)
        self.decode_ms_per_pass = float(decode_ms_per_pass)

    def prefill_ms(self, batch: int, mean_isl: int, mean_prefix: int) -> float:
        new = mean_isl - mean_prefix
        if batch == 0 or new <= 0:
            return 0.0
        return self.pass_overhead_ms + self.prefill_ms_per_token * (batch * new)

    def decode_ms(
        self, batch: int, active_kv_tokens: int, context_length: int, total_kv_tokens: int
    ) -> float:
        return 0.0 if batch == 0 else self.decode_ms_per_pass

    def __repr__(self) -> str:
        return (
            f"FixedPerfModel(prefill_ms_per_token={self.prefill_ms_per_token}, "
            f"pass_overhead_ms={self.pass_overhead_ms}, "
            f"decode_ms_per_pass={self.decode_ms_per_pass})"
        )


def _duration_ns(secs: float) -> int:
    """Rust `Duration::from_secs_f64(secs)` as integer nanoseconds.

    Rust rounds the exact binary value of `secs` to the nearest nanosecond, ties to even
    (core::time `try_from_secs!`); a naive `round(secs * 1e9)` rounds twice and can be off by
    one. Inputs Rust panics on (negative, NaN, 2**64 s and beyond) raise ValueError here.

    Fast path: the float product `p = secs * 1e9` is within `p * 2**-53` of the exact value,
    so when its fraction is farther than that from one half, rounding `p` gives the same
    integer. Only near-ties (and `p >= 2**52`, where the fraction is lost) take the exact path.
    """
    if not 0.0 <= secs < _MAX_DURATION_SECS:
        raise ValueError(f"cannot convert float seconds to Duration: {secs}")
    p = secs * _NS_PER_S_F
    n = int(p)
    frac = p - n
    if abs(frac - 0.5) > p * _TIE_MARGIN:
        return n + 1 if frac > 0.5 else n
    num, den = secs.as_integer_ratio()
    q, r = divmod(num * _NS_PER_S, den)
    twice = r + r
    if twice > den or (twice == den and q & 1):
        q += 1
    return q


def _as_secs_f64(ns: int) -> float:
    """Rust `Duration::as_secs_f64`: whole seconds plus nanos / 1e9, in that float order."""
    return ns // _NS_PER_S + (ns % _NS_PER_S) / _NS_PER_S_F


def scale_ms(ms: float, ratio: float) -> float:
    """Round raw milliseconds to a Rust `Duration` and divide by `ratio` when it is positive.

    Mirrors upstream's `Duration::from_secs_f64(ms / 1000.0)` followed by
    `Duration::from_secs_f64(d.as_secs_f64() / ratio)` for `ratio > 0` and `d > 0`, so the
    rounding happens twice, exactly where Rust does it. `ratio <= 0` leaves the time unscaled
    (the core's "speedup 0" mode). The core passes 0 for prefill (rounding only) and
    `decode_speedup_ratio` for decode when the daemon is paced (engined.core.emission).
    """
    ns = _duration_ns(ms / 1000.0)
    if ratio > 0.0 and ns > 0:
        ns = _duration_ns(_as_secs_f64(ns) / ratio)
    return _as_secs_f64(ns) * 1000.0


def make_perf_model(
    kind: str,
    *,
    prefill_ms_per_token: float = 0.015,
    pass_overhead_ms: float = 16.5,
    decode_ms_per_pass: float = 5.74,
) -> PerfModel:
    """Build the model named by `kind`; the fixed-model keywords are ignored otherwise.

    The fixed defaults are the polynomial's linear prefill terms and its decode time at an
    empty cache, so switching kinds keeps pass lengths in the same range.
    """
    if kind == "polynomial":
        return PolynomialPerfModel()
    if kind == "fixed":
        return FixedPerfModel(prefill_ms_per_token, pass_overhead_ms, decode_ms_per_pass)
    raise InvalidArgsError(f"unknown perf model kind {kind!r}; expected 'polynomial' or 'fixed'")
