"""Random offload workloads: determinism, ownership returned exactly once, tiers left clean."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.core.offload.config import OffloadConfig
from engined.core.offload.tier_engine import TierEngine
from engined.core.offload.tier_values import (
    EvictedBlock,
    OnboardState,
    RetryNow,
    TickEffects,
    TierEventKind,
)
from tests.core.offload.support import key, meta, parent_key, summary

POSITIONS = 6


@st.composite
def configs(draw: st.DrawFn) -> OffloadConfig:
    bandwidths = st.sampled_from([0.0, 0.5, 1.0, 2.0])
    return OffloadConfig(
        num_g2_blocks=draw(st.integers(1, 6)),
        num_g3_blocks=draw(st.one_of(st.none(), st.integers(1, 6))),
        block_size_tokens=4,
        offload_batch_size=draw(st.integers(1, 4)),
        block_size_bytes=draw(st.sampled_from([None, 250_000, 1_000_000])),
        bandwidth_g1_to_g2_gbps=draw(bandwidths),
        bandwidth_g2_to_g1_gbps=draw(bandwidths),
        bandwidth_g2_to_g3_gbps=draw(bandwidths),
        bandwidth_g3_to_g2_gbps=draw(bandwidths),
    )


steps = st.sampled_from([-0.5, 0.0, 0.0, 0.1, 0.25, 0.5, 1.0, 3.0])
tick = st.tuples(st.just("tick"), steps)
swap = st.tuples(
    st.just("swap"),
    st.integers(0, POSITIONS - 1),
    st.integers(1, 3),
    st.integers(0, 2),
    steps,
)
seed = st.tuples(st.just("seed"), st.integers(0, POSITIONS - 1), st.booleans())
operations = st.one_of(
    tick,
    swap,
    seed,
    st.tuples(
        st.just("evict"),
        st.lists(st.integers(0, POSITIONS - 1), min_size=1, max_size=6, unique=True),
        st.booleans(),
        steps,
    ),
    tick,
    st.tuples(st.just("abandon"), st.integers(0, POSITIONS - 1)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
    st.tuples(st.just("take"), st.integers(0, 5)),
    swap,
    seed,
)


@dataclass
class Ledger:
    """G1 ids the engine was given, those it gave back, and each tier's router view."""

    handed: set[int] = field(default_factory=set)
    returned: list[int] = field(default_factory=list)
    next_id: int = 0
    visible: dict[str, set[int]] = field(default_factory=dict)
    trace: list[object] = field(default_factory=list)

    def fresh(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.handed.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        for g1_id in ids:
            assert g1_id in self.handed, f"{g1_id} was never handed to the engine"
            assert g1_id not in self.returned, f"{g1_id} came back twice"
            self.returned.append(g1_id)

    def apply(self, effects: TickEffects) -> None:
        self.trace.append(summary(effects))
        for event in effects.events:
            seen = self.visible.setdefault(event.medium.value, set())
            block = event.block.seq_hash
            if event.kind is TierEventKind.STORED:
                assert block not in seen, f"{event} stored twice"
                seen.add(block)
            else:
                assert block in seen, f"{event} removes an unknown block"
                seen.remove(block)
        self.give_back(effects.released_g1_slots)
        assert len(set(effects.completed_onboards)) == len(effects.completed_onboards)
        for reaped in effects.reaped_onboards:
            self.give_back(reaped.slots + reaped.pins)


def check_links(engine: TierEngine) -> None:
    for link in engine.links():
        assert all(r >= 0.0 for r in link.remaining_bytes())


def run(config: OffloadConfig, ops: list[tuple[object, ...]], cancel_rest: bool) -> Ledger:
    engine = TierEngine(config)
    ledger = Ledger()
    onboards: list[int] = []
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "evict":
            positions, with_meta, step = op[1], op[2], op[3]
            assert isinstance(positions, list) and isinstance(step, float)
            now = max(now + step, 0.0)
            slots = ledger.fresh(len(positions))
            blocks = [
                EvictedBlock(slot, key(p), parent_key(p), meta(p) if with_meta else None)
                for slot, p in zip(slots, positions, strict=True)
            ]
            outcome = engine.enqueue_g1_evictions(blocks, now)
            if isinstance(outcome, RetryNow):
                ledger.apply(outcome.effects)
            else:
                ledger.trace.append(("blocked", outcome.lease_id, outcome.deadline_ms))
                assert engine.offload_wait(outcome.lease_id) is not None
        elif kind == "tick":
            step = op[1]
            assert isinstance(step, float)
            now = max(now + step, 0.0)
            ledger.apply(engine.tick(now))
        elif kind == "swap":
            first, length, num_pins, step = op[1], op[2], op[3], op[4]
            assert isinstance(first, int) and isinstance(length, int)
            assert isinstance(num_pins, int) and isinstance(step, float)
            now = max(now + step, 0.0)
            keys = [key(p) for p in range(first, min(first + length, POSITIONS))]
            plan = engine.prepare_onboard(keys)
            ledger.trace.append(("plan", None if plan is None else tuple(plan.keys)))
            if plan is not None:
                slots = ledger.fresh(plan.block_count)
                pins = ledger.fresh(num_pins)
                onboards.append(engine.start_onboard(plan, slots, pins, now))
        elif kind == "abandon":
            position = op[1]
            assert isinstance(position, int)
            plan = engine.prepare_onboard([key(position)])
            if plan is not None:
                engine.abandon_onboard(plan)
        elif kind == "cancel" and onboards:
            index = op[1]
            assert isinstance(index, int)
            engine.cancel_onboard(onboards.pop(index % len(onboards)))
        elif kind == "take" and onboards:
            index = op[1]
            assert isinstance(index, int)
            onboard = onboards[index % len(onboards)]
            taken = engine.take_completed_onboard(onboard)
            if taken is not None:
                onboards.remove(onboard)
                ledger.give_back(taken[0] + taken[1])
        elif kind == "seed":
            position, lower = op[1], op[2]
            assert isinstance(position, int)
            tier = engine.g3 if lower and engine.g3 is not None else engine.g2
            if tier.available or tier.contains(key(position)):
                tier.seed(key(position), parent_key(position))
        check_links(engine)

    if cancel_rest:
        for onboard in onboards:
            assert engine.cancel_onboard(onboard)
        onboards.clear()
    for _ in range(1000):
        for onboard in list(onboards):
            status = engine.onboard_status(onboard)
            assert status is not None
            if status.state is OnboardState.COMPLETED:
                taken = engine.take_completed_onboard(onboard)
                assert taken is not None
                onboards.remove(onboard)
                ledger.give_back(taken[0] + taken[1])
        deadline = engine.earliest_pending_deadline()
        if deadline is None and engine.is_idle():
            break
        now = max(now, deadline if deadline is not None else now)
        ledger.apply(engine.tick(now))
        check_links(engine)
    assert engine.is_idle()
    assert all(link.is_idle() for link in engine.links())
    for lower in (engine.g2, engine.g3):
        if lower is not None:
            assert lower.pool.num_active == 0
            assert lower.reserved == 0
    assert sorted(ledger.returned) == sorted(ledger.handed)
    return ledger


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(), ops=st.lists(operations, min_size=8, max_size=60), cancel_rest=st.booleans()
)
def test_random_workloads_return_every_g1_id_exactly_once(
    config: OffloadConfig, ops: list[tuple[object, ...]], cancel_rest: bool
) -> None:
    run(config, ops, cancel_rest)


@settings(max_examples=100, deadline=None)
@given(config=configs(), ops=st.lists(operations, min_size=8, max_size=40))
def test_identical_runs_give_identical_effects(
    config: OffloadConfig, ops: list[tuple[object, ...]]
) -> None:
    first = run(config, ops, cancel_rest=False)
    second = run(config, ops, cancel_rest=False)
    assert first.trace == second.trace
    assert first.returned == second.returned


def _scripted() -> list[object]:
    """Two G1 offloads racing onboards through G2 and G3, recorded tick by tick."""
    engine = TierEngine(
        OffloadConfig(
            num_g2_blocks=4,
            num_g3_blocks=4,
            block_size_tokens=4,
            offload_batch_size=2,
            block_size_bytes=250_000,
            bandwidth_g1_to_g2_gbps=1.0,
            bandwidth_g2_to_g1_gbps=4.0,
            bandwidth_g2_to_g3_gbps=0.5,
            bandwidth_g3_to_g2_gbps=1.0,
        )
    )
    record: list[object] = []
    for position in range(4):
        engine.seed_g2(key(position), parent_key(position))
    onboards = []
    for request in range(3):
        plan = engine.prepare_onboard([key(p) for p in range(4)])
        assert plan is not None
        onboards.append(engine.start_onboard(plan, [10 * request + i for i in range(4)], [], 0.0))
    outcome = engine.enqueue_g1_evictions(
        [EvictedBlock(100 + p, key(p, 77), None, meta(p)) for p in range(3)], 0.1
    )
    record.append(type(outcome).__name__)
    for now in (0.5, 0.8, 1.0, 1.5, 3.0, 6.0, 12.0):
        effects = engine.tick(now)
        record.append(summary(effects))
        for onboard in effects.completed_onboards:
            record.append(engine.take_completed_onboard(onboard))
    return record


def test_scripted_replay_is_identical() -> None:
    first = _scripted()
    assert first == _scripted()
    assert any(isinstance(entry, tuple) and entry and entry[0] for entry in first)
