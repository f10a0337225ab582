"""Garbage collection between passes (engined/server/ranks/collector.py).

The collector is driven through a fake of the `gc` module (counts, thresholds, and which
generation each collection took) and a manual clock, so every decision is exact: whether
the earliest deadline of the ranks leaves twice a generation's cost, which generation
CPython would have run, and when the hard limit overrides the lack of room. Then paced
engine loops on a virtual clock (tests/server/virtual_clock.py) show where a loop offers its
waits, and a paced daemon hands collection over and back.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import NamedTuple

import pytest

from engined.core.types import Request, Submit
from engined.server.ranks.collector import HARD_LIMIT, INITIAL_COST_S, Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_build import Pacing
from tests.server.inprocess import engine_loop
from tests.server.support import FinishedDelivery, ipc_config, read_while_serving
from tests.server.virtual_clock import VirtualClock
from tests.support import run, until

THRESHOLDS = (700, 10, 10)


class FakeGc:
    """The `gc` functions the collector uses; a collection resets the counts as CPython's
    does and moves `clock` on by `cost_s`."""

    def __init__(self, clock: VirtualClock, counts: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.clock = clock
        self.counts = list(counts)
        self.collected: list[int] = []
        self.cost_s = 0.0
        self.enabled = True

    def get_count(self) -> tuple[int, int, int]:
        return (self.counts[0], self.counts[1], self.counts[2])

    def get_threshold(self) -> tuple[int, int, int]:
        return THRESHOLDS

    def collect(self, generation: int = 2) -> int:
        self.collected.append(generation)
        if generation < 2:
            self.counts[generation + 1] += 1
        for younger in range(generation + 1):
            self.counts[younger] = 0
        self.clock.now += self.cost_s
        return 0

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True


class Started(NamedTuple):
    collector: Collector
    deadlines: Deadlines
    fake: FakeGc
    clock: VirtualClock


def started(counts: tuple[int, int, int], clock: VirtualClock | None = None) -> Started:
    clock = VirtualClock(100.0) if clock is None else clock
    fake = FakeGc(clock, counts)
    deadlines = Deadlines()
    collector = Collector(deadlines, ops=fake, clock=clock)
    collector.start()
    return Started(collector, deadlines, fake, clock)


class TestDecisions:
    def test_start_and_close_hand_collection_over_and_back(self) -> None:
        collector, _, fake, _ = started((0, 0, 0))
        assert not fake.enabled and collector.running
        collector.close()
        assert fake.enabled and not collector.running

    def test_nothing_below_the_young_threshold(self) -> None:
        collector, _, fake, _ = started((700, 0, 0))
        collector.offer()
        assert fake.collected == []

    def test_a_young_collection_when_every_rank_leaves_room(self) -> None:
        collector, deadlines, fake, clock = started((701, 0, 0))
        deadlines.set(0, clock() + 0.010)
        deadlines.set(1, clock() + 0.020)
        collector.offer()
        assert fake.collected == [0]
        assert collector.collections == [1, 0, 0]
        assert collector.forced == 0

    def test_a_rank_due_soon_holds_it_back(self) -> None:
        collector, deadlines, fake, clock = started((701, 0, 0))
        deadlines.set(0, clock() + 0.010)
        deadlines.set(1, clock() + 2 * INITIAL_COST_S[0] - 0.0001)
        collector.offer()
        assert fake.collected == []
        deadlines.set(1, None)  # it went idle: only rank 0's deadline counts
        collector.offer()
        assert fake.collected == [0]

    def test_a_late_rank_leaves_no_room(self) -> None:
        collector, deadlines, fake, clock = started((701, 0, 0))
        deadlines.set(0, clock() - 0.001)
        collector.offer()
        assert fake.collected == []

    def test_past_the_hard_limit_it_collects_without_room(self) -> None:
        collector, deadlines, fake, clock = started((HARD_LIMIT * 700, 0, 0))
        deadlines.set(0, clock())
        collector.offer()
        assert fake.collected == []
        fake.counts[0] += 1
        collector.offer()
        assert fake.collected == [0]
        assert collector.forced == 1

    @pytest.mark.parametrize(
        ("counts", "room_s", "generation"),
        [
            ((701, 11, 0), 1.0, 1),  # ten young collections since the last middle one
            ((701, 10, 0), 1.0, 0),  # CPython's test is "more than the threshold"
            ((701, 11, 11), 1.0, 2),
            ((701, 11, 11), 2 * INITIAL_COST_S[2] - 0.001, 1),  # no room for a full one
            ((701, 0, 11), 2 * INITIAL_COST_S[2] - 0.001, 1),
            ((701, 0, HARD_LIMIT * 10 + 1), 0.0, 2),  # full, room or not
        ],
    )
    def test_the_generation_is_cpythons_choice_if_it_fits(
        self, counts: tuple[int, int, int], room_s: float, generation: int
    ) -> None:
        collector, deadlines, fake, clock = started(counts)
        deadlines.set(0, clock() + room_s)
        collector.offer()
        assert fake.collected == [generation]

    def test_the_cost_is_learnt_from_the_collections(self) -> None:
        collector, deadlines, fake, clock = started((701, 0, 0))
        fake.cost_s = 0.004
        deadlines.set(0, clock() + 0.010)
        collector.offer()  # 4 ms: the next one needs 8 ms of room
        assert fake.collected == [0]
        fake.counts[0] = 701
        deadlines.set(0, clock() + 0.0079)
        collector.offer()
        assert fake.collected == [0]
        deadlines.set(0, clock() + 0.0081)
        fake.cost_s = 0.0
        collector.offer()  # free this time: the estimate only decays, to 3.2 ms
        assert fake.collected == [0, 0]
        fake.counts[0] = 701
        deadlines.set(0, clock() + 0.0063)
        collector.offer()
        assert fake.collected == [0, 0]
        deadlines.set(0, clock() + 0.0065)
        collector.offer()
        assert fake.collected == [0, 0, 0]

    def test_before_start_and_after_close_it_never_collects(self) -> None:
        clock = VirtualClock()
        fake = FakeGc(clock, (HARD_LIMIT * 700 + 1, 0, 0))
        collector = Collector(Deadlines(), ops=fake, clock=clock)
        collector.offer()
        collector.start()
        collector.close()
        collector.offer()
        assert fake.collected == []


def submit(request_id: str, max_tokens: int) -> Submit:
    return Submit(Request(token_ids=[1, 2, 3, 4], max_tokens=max_tokens, request_id=request_id))


class TestPacedLoops:
    def test_passes_with_room_between_them_collect_there(self) -> None:
        """5 ms passes leave 5 ms of room each (2 ms needed): one young collection per pass,
        with a young generation that is always past its threshold."""

        async def scenario() -> tuple[list[int], int]:
            collector, deadlines, fake, clock = started((0, 0, 0), VirtualClock())
            delivery = FinishedDelivery()
            loop = engine_loop(
                delivery,
                clock=clock,
                sleep=clock.sleep,
                pacing=Pacing(deadlines, collector),
                speedup_ratio=1.0,
                fixed_decode_ms_per_pass=5.0,
            )
            passes: list[float] = []
            loop.pass_observers.append(lambda rank, start, result: passes.append(start))

            def collect(generation: int = 2) -> int:
                FakeGc.collect(fake, generation)
                if "r" not in delivery.finished:
                    fake.counts[0] = 701  # as if the next pass refilled it
                return 0

            fake.collect = collect  # type: ignore[method-assign]
            task = asyncio.ensure_future(loop.run())
            fake.counts[0] = 701
            await loop.call(submit("r", 10))
            await until(lambda: "r" in delivery.finished, "the request done")
            loop.stop()
            await task
            return fake.collected, len(passes)

        collected, passes = run(scenario())
        # Every pass's wait (the first pass is the prefill), and the idle wait at the end.
        assert passes == 10
        assert collected == [0] * (passes + 1)

    def test_a_rank_due_sooner_than_the_cost_holds_the_others_back(self) -> None:
        """Rank 1's 1 ms passes leave less than the 2 ms a young collection needs: while it
        runs, rank 0's 5 ms gaps (and its idle waits) are not used; once it is idle they are."""

        async def scenario() -> list[bool]:
            collector, deadlines, fake, clock = started((0, 0, 0), VirtualClock())
            delivery = FinishedDelivery()
            slow, fast = (
                engine_loop(
                    delivery,
                    rank=rank,
                    clock=clock,
                    sleep=clock.sleep,
                    pacing=Pacing(deadlines, collector),
                    speedup_ratio=1.0,
                    fixed_decode_ms_per_pass=ms,
                )
                for rank, ms in ((0, 5.0), (1, 1.0))
            )
            fast_done: list[bool] = []  # at each collection: had rank 1 finished?

            def collect(generation: int = 2) -> int:
                fast_done.append("fast" in delivery.finished)
                return FakeGc.collect(fake, generation)

            fake.collect = collect  # type: ignore[method-assign]
            tasks = [asyncio.ensure_future(loop.run()) for loop in (slow, fast)]
            await fast.call(submit("fast", 200))
            await slow.call(submit("slow", 10))
            fake.counts[0] = 701
            await until(lambda: bool(fast_done), "a collection")
            for loop in (slow, fast):
                loop.stop()
            await asyncio.gather(*tasks)
            return fast_done

        fast_done = run(scenario())
        assert fast_done == [True]

    def test_an_unpaced_loop_leaves_collection_alone(self) -> None:
        async def scenario() -> list[int]:
            collector, deadlines, fake, _ = started((HARD_LIMIT * 700 + 1, 0, 0))
            delivery = FinishedDelivery()
            loop = engine_loop(delivery, pacing=Pacing(deadlines, collector), speedup_ratio=0.0)
            task = asyncio.ensure_future(loop.run())
            await loop.call(submit("r", 5))
            await until(lambda: "r" in delivery.finished, "the request done")
            loop.stop()
            await task
            return fake.collected

        assert run(scenario()) == []


@pytest.mark.parametrize(("speedup", "taken_over"), [(1.0, True), (0.0, False)])
def test_a_paced_daemon_collects_between_passes(
    tmp_path: Path, speedup: float, taken_over: bool
) -> None:
    cfg = ipc_config(tmp_path, speedup)

    try:
        serving, after = run(read_while_serving(cfg, gc.isenabled))
    finally:
        gc.enable()
        gc.unfreeze()
    assert serving is not taken_over
    assert after
