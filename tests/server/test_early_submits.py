"""Submissions that arrive while a pass is paced are applied on arrival, not at its deadline.

engined/server/ranks/engine_loop.py `_pace`: at the deadline they would run first and hold the due
pass (a burst hashes its prompts). Only submissions at the head of the inbox go early;
anything else keeps its place at the boundary, and so does whatever queues behind it, and
nothing starts within EARLY_MARGIN_S of the deadline. Time is a manual clock
(tests/server/virtual_clock.py) the test moves to exact instants inside the 5 ms passes.
"""

from __future__ import annotations

import asyncio
import contextlib

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import Cancel, Command, Submit
from engined.core.types import Request as CoreRequest
from engined.server.ranks.collector import Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_build import Pacing
from engined.server.ranks.rank_inbox import EARLY_MARGIN_S
from tests.server.inprocess import engine_loop
from tests.server.support import FinishedDelivery
from tests.server.virtual_clock import ManualClock
from tests.support import run, until


def submit(request_id: str, max_tokens: int = 1) -> Submit:
    return Submit(CoreRequest(token_ids=[1, 2, 3, 4], max_tokens=max_tokens, request_id=request_id))


def label(command: Command) -> str:
    if isinstance(command, Submit):
        return command.request.request_id or "?"
    assert isinstance(command, Cancel)
    return f"cancel {command.request_id}"


def test_submissions_apply_on_arrival_and_others_wait_for_the_boundary() -> None:
    assert EARLY_MARGIN_S == 0.0003  # a send at 9.8 ms, 0.2 ms before a deadline, is inside

    async def scenario() -> None:
        clock = ManualClock()
        loop = engine_loop(
            FinishedDelivery(),
            clock=clock,
            sleep=clock.sleep,
            pacing=Pacing(Deadlines(), Collector(Deadlines(), clock=clock)),
            speedup_ratio=1.0,
            fixed_decode_ms_per_pass=5.0,
        )
        applied: list[tuple[str, float]] = []  # (command, clock ms when applied)
        starts: list[float] = []  # pass starts, ms

        def on_command(rank: int, at: float, command: Command, report: CommandReport) -> None:
            applied.append((label(command), round(clock() * 1000, 3)))

        def on_pass(rank: int, start_ms: float, result: PassReport) -> None:
            starts.append(round(start_ms, 3))

        loop.command_observers.append(on_command)
        loop.pass_observers.append(on_pass)
        task = asyncio.ensure_future(loop.run())
        loop.send(submit("long", 400))
        loop.send(submit("victim", 400))
        await until(lambda: starts == [0.0], "the first pass, paced until 5 ms")

        async def at(ms: float, *commands: Command) -> None:
            clock.advance_to(ms / 1000)
            for command in commands:
                loop.send(command)
            await asyncio.sleep(0)

        await at(1.0, submit("a"))
        await until(lambda: len(applied) == 3, "a applied")
        await at(2.0, submit("b"))
        await until(lambda: len(applied) == 4, "b applied")
        # A cancel waits for the boundary, and the submission behind it waits too.
        await at(3.0, Cancel("victim"), submit("c"))
        await at(5.0)
        await until(lambda: len(starts) == 2, "the second pass")
        # Inside the margin before the second pass's deadline (10 ms): at the boundary too.
        await at(9.8, submit("late"))
        await at(10.0)
        await until(lambda: len(applied) == 7, "the late submission applied")
        assert applied == [
            ("long", 0.0),
            ("victim", 0.0),
            ("a", 1.0),
            ("b", 2.0),
            ("cancel victim", 5.0),
            ("c", 5.0),
            ("late", 10.0),
        ]
        assert starts[:2] == [0.0, 5.0]  # the submissions held no pass
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(scenario())
