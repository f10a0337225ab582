"""The deadlines the paced ranks of one event loop share (engined/server/ranks/deadlines.py)."""

from __future__ import annotations

import asyncio

from engined.core.pass_report import PassReport
from engined.core.types import Cancel, Request, Submit
from engined.server.ranks.collector import Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_build import Pacing
from tests.server.inprocess import engine_loop
from tests.server.support import FinishedDelivery
from tests.server.virtual_clock import VirtualClock
from tests.support import run, until


def test_the_earliest_deadline_of_the_ranks_that_wait_on_time() -> None:
    deadlines = Deadlines()
    assert deadlines.earliest() is None
    deadlines.set(0, 5.0)
    deadlines.set(1, 3.0)
    assert deadlines.earliest() == 3.0
    deadlines.set(1, None)  # waits for a command now
    assert deadlines.earliest() == 5.0
    deadlines.set(1, None)
    deadlines.set(0, 7.0)  # a rank has one deadline: the last one set
    assert deadlines.earliest() == 7.0


def test_overdue_looks_at_the_other_ranks_only() -> None:
    deadlines = Deadlines()
    deadlines.set(0, 1.0)
    assert not deadlines.overdue(2.0, but=0)
    assert deadlines.overdue(2.0, but=1)
    assert deadlines.overdue(1.0, but=1)  # due at exactly now counts
    assert not deadlines.overdue(0.5, but=1)
    deadlines.set(2, 9.0)
    assert not deadlines.overdue(2.0, but=0)


def test_a_command_makes_only_a_rank_waiting_for_work_due_now() -> None:
    """Idle, a command wakes the rank: it needs the loop now. Pacing a pass, it applies the
    command at that pass's deadline, which stays what the others see."""

    async def scenario() -> None:
        clock = VirtualClock(10.0)
        deadlines = Deadlines()
        delivery = FinishedDelivery()
        loop = engine_loop(
            delivery,
            clock=clock,
            sleep=clock.sleep,
            pacing=Pacing(deadlines, Collector(deadlines, clock=clock)),
            speedup_ratio=1.0,
            fixed_decode_ms_per_pass=5.0,
        )
        seen: list[float | None] = []

        def on_pass(rank: int, start_ms: float, result: PassReport) -> None:
            before = deadlines.earliest()
            loop.send(Cancel("nobody"))  # refused (unknown), harmless
            seen.append(before)
            seen.append(deadlines.earliest())

        task = asyncio.ensure_future(loop.run())
        await loop.until_idle()  # and so waiting for work
        assert deadlines.earliest() is None
        loop.send(Cancel("nobody"))
        assert deadlines.earliest() == clock()
        loop.pass_observers.append(on_pass)
        await loop.call(Submit(Request(token_ids=[1, 2, 3], max_tokens=3, request_id="r")))
        await until(lambda: "r" in delivery.finished, "the request done")
        loop.stop()
        await task
        assert len(seen) >= 4
        for before, after in zip(seen[::2], seen[1::2], strict=True):
            assert after == before  # a sleeping or running rank's deadline is left alone

    run(scenario())
