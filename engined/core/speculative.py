"""MTP (multi-token prediction) burst sizes: how many tokens one decode forward emits.

Upstream (`common/speculative.rs`) draws from `rand`'s ChaCha12 `StdRng`; no test depends on
the exact stream, only on determinism per seed and on the acceptance statistics, so a private
`random.Random` stands in. The RNG is per sampler, never the module-global one, so two cores in
one process (or two test runs) draw identical streams for identical seeds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from engined.core.errors import InvalidArgsError

_SEED_LIMIT = 1 << 64


class SpeculativeSampler:
    """Samples the length of one MTP burst from per-position acceptance rates.

    `rates[k]` is the probability that draft token k+1 is accepted given all earlier ones
    were; the burst is the always-emitted base token plus the accepted run, capped by the
    tokens the request may still produce.

    `seed` must already be a u64: the caller computes `(aic_mtp_seed + worker_id) % 2**64`,
    upstream's `wrapping_add`, so each worker of a fleet draws its own stream. Out-of-range
    seeds are refused rather than wrapped here, because `random.Random` would silently take
    the absolute value of a negative seed and collide with another worker's stream.
    """

    __slots__ = ("_random", "_rates")

    def __init__(self, rates: Sequence[float], seed: int) -> None:
        for rate in rates:
            if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
                raise InvalidArgsError(f"MTP acceptance rate must be in [0, 1], got {rate}")
        if not 0 <= seed < _SEED_LIMIT:
            raise InvalidArgsError(f"MTP seed must be a u64, got {seed}")
        self._rates = tuple(float(rate) for rate in rates)
        self._random = random.Random(seed).random

    @property
    def rates(self) -> tuple[float, ...]:
        return self._rates

    def sample_output_tokens(self, remaining: int, draw: Callable[[], float] | None = None) -> int:
        """Tokens emitted by one forward for a request that may still produce `remaining`.

        `random() < rate` is always true for 1.0 and always false for 0.0, matching
        `random_bool`'s exact behaviour at the endpoints, so tests with 0/1 rates are
        deterministic whatever the seed.
        """
        if remaining <= 0:
            return 0
        out = 1
        if draw is None:
            draw = self._random
        for rate in self._rates:
            if draw() >= rate:
                break
            out += 1
        return out if out < remaining else remaining
