"""A burst of commands cannot hold a due pass (engined/server/ranks/engine_loop.py `_drain_inbox`).

Paced with requests running, a pass boundary applies queued commands for at most
INBOX_TURN_S of the loop's clock and leaves the rest to the next boundary. Time is a
virtual clock (tests/server/virtual_clock.py) that each applied command moves on by 0.4 ms,
so the number of commands per boundary is exact whatever the machine: three (0.4, 0.8, 1.2
ms; the third ends the 1 ms turn), and one when another rank of the loop is already due
(engined/server/ranks/deadlines.py: its pass goes first). Unpaced, a boundary applies them all.

Submissions that arrive while a pass is paced are applied in the wait (`_pace`) up to
EARLY_MARGIN_S before its deadline, so the counts below are of commands applied before
each pass: the burst arrives during the first pass's short wait (3 fit before its deadline
less the margin). That turn ends 1.2 ms past the deadline, and the 5 ms decode pass keeps
its schedule (it ends 5 ms after the deadline, not after its late start), so its wait takes
9 and its boundary turn 3, and the last 5 go in the next wait. With another rank due,
nothing is applied early.
"""

from __future__ import annotations

import asyncio

import pytest

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import Command, Submit
from engined.core.types import Request as CoreRequest
from engined.server.ranks.collector import Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_build import Pacing
from engined.server.ranks.rank_inbox import EARLY_MARGIN_S, INBOX_TURN_S
from tests.server.inprocess import engine_loop
from tests.server.support import FinishedDelivery
from tests.server.virtual_clock import VirtualClock
from tests.support import run, until

COMMAND_COST_S = 0.0004
BURST = 20


def request(request_id: str, max_tokens: int) -> Submit:
    return Submit(CoreRequest(token_ids=[1, 2, 3, 4], max_tokens=max_tokens, request_id=request_id))


@pytest.mark.parametrize(
    ("speedup", "other_rank_due", "per_boundary"),
    [
        (1.0, False, [3, 12, 5]),
        # Another rank of the loop already due: one command per boundary, its pass first.
        (1.0, True, [1] * BURST),
        (0.0, False, [20]),
    ],
)
def test_a_burst_is_applied_a_turn_per_pass(
    speedup: float, other_rank_due: bool, per_boundary: list[int]
) -> None:
    # The figures above assume the 1 ms turn and the 0.3 ms margin.
    assert (INBOX_TURN_S, EARLY_MARGIN_S) == (0.001, 0.0003)

    async def scenario() -> None:
        clock = VirtualClock()
        delivery = FinishedDelivery()
        deadlines = Deadlines()
        if other_rank_due:
            deadlines.set(1, -1.0)
        loop = engine_loop(
            delivery,
            clock=clock if speedup else None,
            sleep=clock.sleep if speedup else None,
            pacing=Pacing(deadlines, Collector(deadlines, clock=clock)),
            speedup_ratio=speedup,
            fixed_decode_ms_per_pass=5.0,
        )
        applied: list[str] = []
        boundaries: list[int] = []  # commands of the burst applied before each pass

        def on_command(rank: int, at: float, command: Command, report: CommandReport) -> None:
            request_id = command.request.request_id if isinstance(command, Submit) else None
            if request_id is not None and request_id != "long":
                applied.append(request_id)
                clock.now += COMMAND_COST_S

        def on_pass(rank: int, start_ms: float, result: PassReport) -> None:
            if applied and (not boundaries or len(applied) != sum(boundaries)):
                boundaries.append(len(applied) - sum(boundaries))

        loop.command_observers.append(on_command)
        loop.pass_observers.append(on_pass)
        task = asyncio.ensure_future(loop.run())
        await loop.call(request("long", 400))  # running, so passes are due
        for n in range(BURST):
            loop.send(request(f"b{n}", 1))
        await until(lambda: len(applied) == BURST, "the burst applied")
        # The last commands may be applied in a pass's wait: they count at that pass.
        await until(lambda: sum(boundaries) == BURST, "every command counted at its pass")
        assert applied == [f"b{n}" for n in range(BURST)]  # in arrival order
        assert boundaries == per_boundary
        loop.stop()
        await until(lambda: "long" in delivery.finished, "the long request done")
        await task

    run(scenario())
