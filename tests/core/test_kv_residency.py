"""KV block residency samples (`kv_cache_metrics`): vLLM's `KVCacheMetricsCollector` rules.

The pool-level tests drive `PagedBlockPool` call by call at chosen core times, so every figure
is known: a block's lifetime runs from the allocation that sampled it to the allocation that
takes its slot again, its idle time from its last prefix hit (its allocation without one),
and its reuse gaps are the gaps between its last four hits. The engine-level test checks that
the samples reach the `PassResult`, stamped with the pass and command times.
"""

from __future__ import annotations

import pytest

from engined.core.args import PerfModelKind, Semantics
from engined.core.engine import Engine
from engined.core.errors import InvalidArgsError
from engined.core.kv_event_log import KvEventLog
from engined.core.kv_residency import KvBlockEviction
from engined.core.paged.block_pool import PagedBlockPool
from engined.core.paged.residency import BlockResidency
from engined.core.types import Request, Submit
from tests.core.factories import make_args


def sampled_pool(num_blocks: int = 4, rate: float = 1.0) -> tuple[PagedBlockPool, BlockResidency]:
    residency = BlockResidency(rate, seed=0)
    log = KvEventLog(4, dp_rank=0, publish=True)
    return PagedBlockPool(num_blocks, caching=True, log=log, residency=residency), residency


def test_lifetime_idle_and_reuse_gaps_of_reallocated_blocks() -> None:
    pool, residency = sampled_pool()
    assert pool.get_new_blocks(2, 0.0) == [1, 2]
    pool.touch([1], 5.0)
    pool.touch([1], 7.0)
    pool.free_blocks([2, 1, 1, 1])  # three handles on block 1 (its allocation and two hits)
    assert residency.take() == []  # freed is not evicted: the slot is not taken yet
    # Uncached blocks freed go to the front in the order freed: 2, then 1, then never-used 3.
    assert pool.get_new_blocks(3, 20.0) == [2, 1, 3]
    assert residency.take() == [
        KvBlockEviction(20.0, 20.0, ()),
        KvBlockEviction(20.0, 13.0, (2.0,)),
    ]
    assert residency.take() == []


def test_only_the_last_four_hits_count_and_a_reset_drops_every_record() -> None:
    pool, residency = sampled_pool()
    pool.get_new_blocks(1, 1.0)
    for now in (2.0, 4.0, 8.0, 16.0, 32.0):
        pool.touch([1], now)
    pool.free_blocks([1] * 6)
    pool.get_new_blocks(3, 40.0)  # 1 again (front), then 2 and 3
    assert residency.take() == [KvBlockEviction(39.0, 8.0, (4.0, 8.0, 16.0))]
    pool.free_blocks([1, 2, 3])
    assert pool.reset()
    pool.get_new_blocks(3, 50.0)
    assert residency.take() == []  # the records before the reset are gone, unreported


def test_sampling_follows_the_rate_and_the_seed() -> None:
    """A quarter of the blocks, drawn from the seed: the same seed samples as many again."""

    def sampled(seed: int) -> int:
        residency = BlockResidency(0.25, seed)
        log = KvEventLog(4, dp_rank=0, publish=True)
        pool = PagedBlockPool(64, caching=True, log=log, residency=residency)
        pool.get_new_blocks(63, 0.0)
        pool.free_blocks(range(1, 64))
        pool.get_new_blocks(63, 0.0)
        return len(residency.take())

    counts = [sampled(seed) for seed in range(6)]
    assert counts == [sampled(seed) for seed in range(6)]
    assert all(5 < count < 30 for count in counts), counts  # about a quarter of 63
    assert len(set(counts)) > 1, counts


def test_an_engine_reports_evictions_in_the_pass_after_them() -> None:
    """vLLM semantics, 2 usable blocks of 4 tokens: A's block is evicted by C's allocation
    200 ms after A allocated it; the pass that allocated it reports it."""
    args = make_args(
        semantics=Semantics.VLLM,
        num_gpu_blocks=3,
        enable_prefix_caching=True,
        kv_cache_metrics=True,
        kv_cache_metrics_sample=1.0,
        perf_model=PerfModelKind.FIXED,
    )
    core = Engine(args)
    evictions: list[KvBlockEviction] = []
    for n, start in enumerate((0.0, 100.0, 200.0)):
        prompt = [10 * n + i for i in range(4)]
        core.apply(
            Submit(Request(token_ids=prompt, max_tokens=1, request_id=f"r{n}")), now_ms=start
        )
        now = start
        while not core.is_empty():
            result = core.execute_pass(now)
            evictions += result.kv_block_evictions
            now = result.end_ms
    assert evictions == [KvBlockEviction(200.0, 200.0, ())]


def test_kv_cache_metrics_needs_vllm_semantics_and_a_rate_in_range() -> None:
    with pytest.raises(InvalidArgsError) as refused:
        Engine(make_args(semantics=Semantics.MOCKER_1_3_0, kv_cache_metrics=True))
    assert refused.value.key == "kv_cache_metrics"
    assert "needs vLLM semantics" in str(refused.value)
    for rate in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidArgsError) as bad:
            make_args(kv_cache_metrics_sample=rate).normalized()
        assert bad.value.key == "kv_cache_metrics_sample"
        assert "kv_cache_metrics_sample must be in (0, 1]" in str(bad.value)


def test_without_kv_cache_metrics_nothing_is_sampled() -> None:
    core = Engine(make_args(semantics=Semantics.VLLM, enable_prefix_caching=True))
    assert core.parts.kv.pool.residency is None  # type: ignore[union-attr]
    core.apply(Submit(Request(token_ids=[1, 2, 3, 4, 5], max_tokens=3)), now_ms=0.0)
    now = 0.0
    while not core.is_empty():
        result = core.execute_pass(now)
        assert result.kv_block_evictions == []
        now = result.end_ms
