"""The made-up logprob values of a simulated engine, by request key, position and token.

Shared by engined's OpenAI server (`engined.openai.logprobs`, which shapes them as vLLM's
APIs do) and the Dynamo worker (`engined.dynamo.engine_outputs`, as dynamo.vllm's chunks carry
them): one rule, so both answer a request alike. The distribution is described there.
"""

from __future__ import annotations

import math
from typing import Final, NamedTuple

_MASK: Final = (1 << 64) - 1
_UNIT: Final = float(1 << 53)
# Logprobs are cut (down, so the probabilities still sum below 1) to 4 decimals, which
# every JSON encoder writes alike.
_SCALE: Final = 10_000


def _mix(value: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value from any integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def _unit(state: int) -> float:
    return (state >> 11) / _UNIT


class PositionLogprobs(NamedTuple):
    """One position as vLLM's engine reports it: the sampled token's logprob and rank, and
    `(token_id, logprob)` pairs, the sampled token first, then the top k in rank order;
    `ranks` holds each entry's rank."""

    logprob: float
    rank: int
    entries: list[tuple[int, float]]
    ranks: list[int]


def position_logprobs(
    token_id: int, position: int, k: int, *, key: int, vocab_size: int
) -> PositionLogprobs:
    """The made-up distribution at `position` of the request with `key`, `k` ranks deep."""
    k = max(0, min(k, vocab_size - 1))
    state = _mix(key * 0x100000001B3 ^ position)
    top = 0.5 + 0.48 * _unit(state)
    state = _mix(state)
    decay = 0.3 + 0.4 * _unit(state)
    state = _mix(state)
    draw = _unit(state)
    rank = 1 if draw < 0.75 else 2 if draw < 0.9 else 3 + int((draw - 0.9) * 80)
    rank = min(rank, vocab_size)

    def logprob(r: int) -> float:
        mass = top if r == 1 else (1 - top) * (1 - decay) * decay ** (r - 2)
        return math.floor(math.log(mass) * _SCALE) / _SCALE

    entries = [(token_id, logprob(rank))]
    ranks = [rank]
    taken = {token_id}
    for r in range(1, k + 1):
        if r == rank:
            continue
        state = _mix(state)
        other = state % vocab_size
        while other in taken:
            other = (other + 1) % vocab_size
        taken.add(other)
        entries.append((other, logprob(r)))
        ranks.append(r)
    return PositionLogprobs(entries[0][1], rank, entries, ranks)
