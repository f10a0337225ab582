"""Forward-pass metrics of one pass, computed as Dynamo's `build_fpm_snapshot` does.

Prefill work is measured per request scheduled with prompt tokens in this pass: the chunk it
computed, the prefix it already had, and (for the variance) its full prompt length. Decode
work is every other scheduled request, measured by its sequence length at schedule time, so a
request that completes in the pass still counts. Variances of the scheduled work are Welford
population variances, to match upstream to the last bit; those of the queued requests are
exact (engined/core/queued.py explains why they are not walked).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import NamedTuple

from engined.core.state import RequestState
from engined.core.types import FpmSnapshot

_scheduled_len = attrgetter("scheduled_len")


class LengthStats(NamedTuple):
    """Count, sum and population variance of a multiset of lengths."""

    num: int
    total: int
    variance: float


class ScheduledWork(NamedTuple):
    total_tokens: int
    prompt_tokens: int
    prefix_tokens: int
    prompt_len: int
    sequence_len: int
    # The request has no token to produce (max_tokens 0): not a decode.
    terminal: bool


def welford(values: Iterable[int]) -> LengthStats:
    """Count, sum and population variance."""
    n = 0
    total = 0
    mean = 0.0
    m2 = 0.0
    for x in values:
        n += 1
        total += x
        delta = x - mean
        mean += delta / n
        m2 += delta * (x - mean)
    return LengthStats(n, total, m2 / n if n else 0.0)


def build_snapshot(
    scheduled: list[ScheduledWork | RequestState],
    queued_prefill: LengthStats,
    queued_decode: LengthStats,
    wall_time_secs: float,
) -> FpmSnapshot:
    """The snapshot of one pass; the queued halves are (count, sum, variance) of lengths,
    tallied as requests queue (engined/core/queued.py) rather than walked each pass. A
    request among `scheduled` is a one-token decode, by its `scheduled_len`."""
    n_qp, sum_qp, var_qp = queued_prefill
    n_qd, sum_qd, var_qd = queued_decode
    try:
        # A pass of one-token decodes only (the steady case): their lengths at C speed, and
        # the Welford steps alone per request. A ScheduledWork among them has no
        # `scheduled_len` and sends the pass to the general walk below.
        lengths = list(map(_scheduled_len, scheduled))
    except AttributeError:
        pass
    else:
        n = len(lengths)
        mean = 0.0
        m2 = 0.0
        for k, x in enumerate(lengths, 1):
            delta = x - mean
            mean += delta / k
            m2 += delta * (x - mean)
        return FpmSnapshot(
            num_prefill_requests=0,
            sum_prefill_tokens=0,
            var_prefill_length=0.0,
            sum_prefill_kv_tokens=0,
            num_decode_requests=n,
            sum_decode_kv_tokens=sum(lengths),
            var_decode_kv_tokens=m2 / n if n else 0.0,
            num_queued_prefill=n_qp,
            sum_queued_prefill_tokens=sum_qp,
            var_queued_prefill_length=var_qp,
            num_queued_decode=n_qd,
            sum_queued_decode_kv_tokens=sum_qd,
            var_queued_decode_kv_tokens=var_qd,
            wall_time_secs=wall_time_secs,
        )
    prefill_lengths: list[int] = []
    prefill_tokens = 0
    prefill_kv = 0
    # The decode lengths' Welford runs inline (the steps of `welford`, in the same order, so
    # the same bits): one decode per running request per pass, and no list of them.
    n_decode = 0
    sum_decode = 0
    mean = 0.0
    m2 = 0.0
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
        # Exact: a length is far below 2**53, so `x - mean` subtracts float(x), exactly
        # `welford`'s steps.
        delta = x - mean
        mean += delta / n_decode
        m2 += delta * (x - mean)
    var_decode = m2 / n_decode if n_decode else 0.0
    n_prefill, _, var_prefill = welford(prefill_lengths)
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
