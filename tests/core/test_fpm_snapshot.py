"""`build_snapshot` against an independent oracle: the exact population variance.

A one-token decode is the request itself in the scheduled work (by its `scheduled_len`);
other work a `ScheduledWork`. Every variance must be the exact one correctly rounded, which
`statistics.pvariance` computes in fractions; and a decode-only pass (the fast path) must
give what the general walk gives.
"""

from __future__ import annotations

import random
import statistics

from hypothesis import given
from hypothesis import strategies as st

from engined.core.fpm import LengthStats, ScheduledWork, build_snapshot
from engined.core.sequence import Sequence
from engined.core.state import RequestState, RequestStatus


def _decode(length: int) -> RequestState:
    """A running request scheduled for a one-token decode at sequence length `length`."""
    seq = Sequence(
        [1, 2, 3],
        4,
        16,
        caching=True,
        rng=random.Random(0),
        token_bits=random.Random(0).getrandbits,
        next_partial_id=iter(range(10)).__next__,
    )
    req = RequestState("r", seq, RequestStatus.RUNNING)
    req.scheduled_len = length
    return req


_lengths = st.integers(min_value=1, max_value=1 << 20)


def pvariance(lengths: list[int]) -> float:
    """The oracle: exact in fractions, rounded once; 0.0 for no lengths."""
    return float(statistics.pvariance(lengths)) if lengths else 0.0


_work = st.one_of(
    _lengths.map(_decode),
    st.builds(
        ScheduledWork,
        request_id=st.just("w"),
        total_tokens=st.integers(1, 8192),
        prompt_tokens=st.integers(0, 8192),
        prefix_tokens=st.integers(0, 8192),
        prompt_len=_lengths,
        sequence_len=_lengths,
        terminal=st.booleans(),
    ),
)


@given(st.lists(_work, max_size=300))
def test_snapshot_variances_are_welfords(scheduled: list[ScheduledWork | RequestState]) -> None:
    decode: list[int] = []
    prefill: list[ScheduledWork] = []
    for work in scheduled:
        if isinstance(work, RequestState):
            decode.append(work.scheduled_len)
        elif work.prompt_tokens > 0:
            prefill.append(work)
        elif not work.terminal:
            decode.append(work.sequence_len)
    none = LengthStats(0, 0, 0.0)

    snap = build_snapshot(scheduled, none, none, 0.5)

    assert (snap.num_decode_requests, snap.sum_decode_kv_tokens) == (len(decode), sum(decode))
    assert snap.var_decode_kv_tokens == pvariance(decode)  # the same bits, not approximately
    prompt_lens = [w.prompt_len for w in prefill]
    assert (snap.num_prefill_requests, snap.var_prefill_length) == (
        len(prefill),
        pvariance(prompt_lens),
    )
    assert snap.sum_prefill_tokens == sum(w.total_tokens for w in prefill)
    assert snap.sum_prefill_kv_tokens == sum(w.prefix_tokens for w in prefill)


def test_a_decode_only_pass() -> None:
    scheduled: list[ScheduledWork | RequestState] = [_decode(512), _decode(514), _decode(513)]
    snap = build_snapshot(scheduled, LengthStats(0, 0, 0.0), LengthStats(0, 0, 0.0), 0.0)
    assert (snap.num_decode_requests, snap.sum_decode_kv_tokens) == (3, 1539)
    assert snap.var_decode_kv_tokens == 2 / 3
    assert snap.num_prefill_requests == 0
