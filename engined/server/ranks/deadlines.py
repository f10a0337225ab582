"""When each paced rank of one event loop next needs the loop.

The ranks of a process share one event loop, and work that one of them does between passes
(applying its queued commands, offering the garbage collector a gap) delays every other
rank whose pass falls due meanwhile, and so does a turn of the control reader. Each paced
`EngineLoop` records here the deadline of its next pass, the moment a command wakes it from
waiting for work, or nothing while it waits; the other ranks, the collector and the control
reader read it to leave room for the rank that needs the loop soonest.
"""

from __future__ import annotations


class Deadlines:
    """The next deadline of every paced rank of one event loop (seconds of its clock)."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due: dict[int, float] = {}

    def set(self, rank: int, deadline: float | None) -> None:
        """`rank` needs the loop at `deadline`; None: not before a command wakes it."""
        if deadline is None:
            self._due.pop(rank, None)
        else:
            self._due[rank] = deadline

    def earliest(self) -> float | None:
        """The soonest deadline of any rank; None when every rank waits for work."""
        return min(self._due.values(), default=None)

    def overdue(self, now: float, but: int | None) -> bool:
        """Whether a rank (other than `but`) is already due at `now`: it waits for the loop."""
        return any(deadline <= now for rank, deadline in self._due.items() if rank != but)
