"""Property: with G2 (and G3) offload on, any workload drains with clean events on every tier.

Random arrivals and cancels over passes at increasing times, prompts sharing prefixes, a
small G1 pool (evictions everywhere), a small G2 and sometimes a G3, block bytes and links
such that one block takes 0.2-4 ms to move, MTP on and off, prefix caching on, either
prefix-hit rule, raw ids or a small vocabulary. Offload ticks
(`tick_offload_only`) are interleaved with the passes. At the end every request has
completed (or was cancelled), a final tick past every deadline leaves no transfer, the core is
drained, no block is held in any tier, and the reference indexer, with lower tiers indexed as
Dynamo's continuation edges, saw no violation on any medium.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, PrefixHitRule
from engined.core.engine import Engine
from engined.core.types import (
    BlockRemoved,
    BlockStored,
    Cancel,
    EndedRequest,
    FinishReason,
    Medium,
    Request,
)
from tests.core.factories import (
    active_blocks,
    lineage_kv,
    submit,
    view,
)
from tests.reference_indexer import ReferenceIndexer

STEPS_MS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@st.composite
def workloads(
    draw: st.DrawFn,
) -> tuple[EngineArgs, list[tuple[int, Request]], list[tuple[int, int]], list[float], list[bool]]:
    block_size = draw(st.sampled_from([2, 4]))
    mtp = draw(st.booleans())
    g3 = draw(st.booleans())
    bandwidths = st.sampled_from([0.5, 1.0, 2.0])
    args = EngineArgs(
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(4, 12)),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(2, 4 * block_size + 8)),
        enable_prefix_caching=True,
        enable_chunked_prefill=draw(st.booleans()),
        aic_nextn=draw(st.integers(1, 2)) if mtp else None,
        aic_nextn_accept_rates=draw(st.sampled_from(["1,1", "0.5,0.5"])) if mtp else None,
        speedup_ratio=0.0,
        seed=draw(st.integers(0, 3)),
        num_g2_blocks=draw(st.integers(1, 8)),
        num_g3_blocks=draw(st.integers(1, 8)) if g3 else None,
        # block bytes = block_size x kv_bytes_per_token: 100 KB - 2 MB per block.
        kv_bytes_per_token=draw(st.sampled_from([50_000, 125_000, 500_000])),
        offload_batch_size=draw(st.integers(1, 4)),
        bandwidth_g1_to_g2_gbps=draw(bandwidths),
        bandwidth_g2_to_g1_gbps=draw(bandwidths),
        bandwidth_g2_to_g3_gbps=draw(bandwidths),
        bandwidth_g3_to_g2_gbps=draw(bandwidths),
        prefix_hit_rule=draw(st.sampled_from(list(PrefixHitRule))),
        vocab_size=draw(st.sampled_from([None, 4, 1000])),
        excluded_token_ids=draw(st.sampled_from([(), (0, 1)])),
    )
    alphabet = st.integers(0, 3)
    prefixes = draw(
        st.lists(st.lists(alphabet, min_size=1, max_size=3 * block_size), min_size=1, max_size=3)
    )
    arrivals = []
    count = draw(st.integers(1, 12))
    for n in range(count):
        tokens = draw(st.sampled_from(prefixes)) + draw(st.lists(alphabet, max_size=2 * block_size))
        arrivals.append(
            (
                draw(st.integers(0, 24)),
                Request(token_ids=tokens, max_tokens=draw(st.integers(0, 6)), request_id=f"r{n}"),
            )
        )
    cancels = draw(st.lists(st.tuples(st.integers(0, 24), st.integers(0, count - 1)), max_size=3))
    steps = draw(st.lists(st.sampled_from(STEPS_MS), min_size=1, max_size=12))
    ticks = draw(st.lists(st.booleans(), min_size=1, max_size=12))
    return args, sorted(arrivals, key=lambda a: a[0]), cancels, steps, ticks


def apply_checked(indexer: ReferenceIndexer, events: list[object], seen: set[str]) -> None:
    for kv_event in events:
        assert isinstance(kv_event, BlockStored | BlockRemoved), f"unexpected {kv_event!r}"
        seen.add(f"{type(kv_event).__name__} {kv_event.medium}")
    indexer.apply(events)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_offload_workloads_drain_with_clean_events_on_every_tier(
    workload: tuple[
        EngineArgs, list[tuple[int, Request]], list[tuple[int, int]], list[float], list[bool]
    ],
) -> None:
    args, arrivals, cancels, steps, ticks = workload
    core = Engine(args)
    assert core.metrics().g2_total_blocks > 0, "the args ask for offload tiers"
    indexer = ReferenceIndexer(args.block_size, lower_tier_edges=True)
    finished: set[str] = set()
    cancelled: set[str] = set()
    received: set[str] = set()
    seen: set[str] = set()
    now = 0.0
    pass_no = 0
    pending = list(arrivals)
    while pending or not core.is_empty():
        while pending and pending[0][0] <= pass_no:
            request = pending.pop(0)[1]
            submit(core, request)
            received.add(request.request_id or "")
        for at_pass, n in cancels:
            request_id = f"r{n}"
            if at_pass == pass_no and core.inspect(request_id) is not None:
                cancel = core.apply(Cancel(request_id), now_ms=now)
                assert cancel.ended == [EndedRequest(request_id, FinishReason.CANCELLED)]
                apply_checked(indexer, list(cancel.kv_events), seen)
                cancelled.add(request_id)
        if ticks[pass_no % len(ticks)]:
            # A tick at the coming pass's time, as an offline replay advances the tiers first.
            now += steps[(pass_no + 1) % len(steps)]
            effects = core.advance_tiers(now)
            apply_checked(indexer, list(effects.kv_events), seen)
            assert effects.lifecycle_events == []
        result = core.execute_pass(now)
        assert result.end_ms >= now
        apply_checked(indexer, list(result.kv_events), seen)
        if core.queues().parked:
            seen.add("parked onboard")
        queues = core.queues()
        if any(
            view(core, r).offload_wait is not None
            for r in queues.waiting + queues.running + queues.parked
        ):
            seen.add("offload wait")
        for out in result.request_outputs():
            assert out.request_id not in finished, "output after the last output"
            for token_id in out.new_token_ids:
                assert token_id not in args.excluded_token_ids
                assert args.vocab_size is None or token_id < args.vocab_size
            if out.finish_reason is not None:
                finished.add(out.request_id)
        now = max(result.end_ms, now + steps[pass_no % len(steps)])
        pass_no += 1
        assert pass_no < 3000, "workload did not drain"

    assert finished | cancelled == received
    for what in sorted(seen):
        event(what)
    # Past every deadline: transfers still running (G1->G2 copies of the last evictions,
    # background G2->G3 copies, cancelled onboards) land and give everything back.
    deadline = core.next_deadline()
    for _ in range(1000):
        if deadline is None:
            break
        effects = core.advance_tiers(max(deadline, now))
        apply_checked(indexer, list(effects.kv_events), seen)
        deadline = core.next_deadline()
    assert core.next_deadline() is None
    assert core.is_drained()
    assert core.queues().parked == []
    assert active_blocks(core) == 0
    offload = core.parts.kv.offload
    assert offload is not None
    assert offload.engine.is_idle()
    assert offload.engine.g2.pool.num_active == 0
    assert offload.engine.g3 is None or offload.engine.g3.pool.num_active == 0
    metrics = core.metrics()
    assert metrics.running == 0 and metrics.waiting == 0
    assert metrics.g2_active_blocks == 0 and metrics.g3_active_blocks == 0
    indexer.assert_clean()
    # What the indexer holds per tier is exactly what each tier holds with metadata.
    assert indexer.num_blocks() == lineage_kv(core).pool.num_registered
    assert indexer.num_blocks(medium=Medium.CPU) == len(offload.engine.g2.meta)
    if offload.engine.g3 is not None:
        assert indexer.num_blocks(medium=Medium.STORAGE) == len(offload.engine.g3.meta)
