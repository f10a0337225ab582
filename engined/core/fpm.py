"""Forward-pass metrics of one pass, computed as Dynamo's `build_fpm_snapshot` does.

Prefill work is measured per request scheduled with prompt tokens in this pass: the chunk it
computed, the prefix it already had, and (for the variance) its full prompt length. Decode
work is every other scheduled request, measured by its sequence length at schedule time, so a
request that completes in the pass still counts.

Every variance, of the scheduled work here and of the queued requests
(engined/core/queued.py), is the population variance computed exactly in integers and rounded
once (`exact_stats`): the correctly rounded value. Dynamo runs a Welford loop over a hash
map, so its last bit depends on the map's order; the exact value is what every order
approximates. It is also cheaper than the float recurrence (a decode pass sums every running
request): 2.0 against 3.3 µs compiled and 20 against 33 µs pure for 256 decodes.
"""

from __future__ import annotations

from typing import NamedTuple

from engined.core.named_tuples import new_tuple
from engined.core.state import RequestState
from engined.core.types import FpmSnapshot


class LengthStats(NamedTuple):
    """Count, sum and population variance of a multiset of lengths."""

    num: int
    total: int
    variance: float


class ScheduledWork(NamedTuple):
    request_id: str
    total_tokens: int
    prompt_tokens: int
    prefix_tokens: int
    prompt_len: int
    sequence_len: int
    # The request has no token to produce (max_tokens 0): not a decode.
    terminal: bool


def exact_stats(n: int, total: int, squares: int) -> LengthStats:
    """The stats of `n` lengths from their sum and sum of squares: the variance exact in
    integers, with one rounding in the division (Python's int / int rounds correctly)."""
    if n == 0:
        return new_tuple(LengthStats, (0, 0, 0.0))
    return new_tuple(LengthStats, (n, total, (n * squares - total * total) / (n * n)))


def length_stats(lengths: list[int]) -> LengthStats:
    """Count, sum and population variance of `lengths` (`exact_stats`)."""
    # NOTE: a loop, not sum(map(mul, ...)): compiled, it runs on machine ints; in CPython
    # the two cost about the same.
    total = 0
    squares = 0
    for x in lengths:
        total += x
        squares += x * x
    return exact_stats(len(lengths), total, squares)


def build_snapshot(
    scheduled: list[ScheduledWork | RequestState],
    queued_prefill: LengthStats,
    queued_decode: LengthStats,
    wall_time_secs: float,
) -> FpmSnapshot:
    """The snapshot of one pass; the queued halves are (count, sum, variance) of lengths,
    tallied as requests queue (engined/core/queued.py) rather than walked each pass. A
    request among `scheduled` is a one-token decode, by its `scheduled_len`."""
    prefill_lengths: list[int] = []
    prefill_tokens = 0
    prefill_kv = 0
    n_decode = 0
    sum_decode = 0
    squares = 0
    for work in scheduled:
        if isinstance(work, RequestState):
            # A one-token decode by its sequence length (PassContext.scheduled).
            x = work.scheduled_len
        elif work.prompt_tokens > 0:
            prefill_lengths.append(work.prompt_len)
            prefill_tokens += work.total_tokens
            prefill_kv += work.prefix_tokens
            continue
        elif not work.terminal:
            x = work.sequence_len
        else:
            continue
        n_decode += 1
        sum_decode += x
        squares += x * x
    _, _, var_decode = exact_stats(n_decode, sum_decode, squares)
    n_prefill, _, var_prefill = length_stats(prefill_lengths)
    n_qp, sum_qp, var_qp = queued_prefill
    n_qd, sum_qd, var_qd = queued_decode
    return FpmSnapshot(
        num_prefill_requests=n_prefill,
        sum_prefill_tokens=prefill_tokens,
        var_prefill_length=var_prefill,
        sum_prefill_kv_tokens=prefill_kv,
        num_decode_requests=n_decode,
        sum_decode_kv_tokens=sum_decode,
        var_decode_kv_tokens=var_decode,
        num_queued_prefill=n_qp,
        sum_queued_prefill_tokens=sum_qp,
        var_queued_prefill_length=var_qp,
        num_queued_decode=n_qd,
        sum_queued_decode_kv_tokens=sum_qd,
        var_queued_decode_kv_tokens=var_qd,
        wall_time_secs=wall_time_secs,
    )
