"""A random P/D workload driver shared by property tests of the waiting queue's bookkeeping.

`drive` applies `(op, n, prompt)` steps to an engine (submits, cancels, destination
reservations, activations and cancels, passes, idle waits) and calls `check` after every
step; `settle` then activates what got reserved, runs the engine down, cancels what could
never finish (a destination that never fits blocks the queue, as upstream's does), and checks
after every step too. The tests differ only in what `check` compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from engined.core.engine import Engine
from engined.core.errors import CoreError
from engined.core.types import (
    ActivateDestination,
    Cancel,
    CancelDestination,
    Command,
    Request,
    ReserveDestination,
    Submit,
)

PROMPTS = [list(range(100, 100 + n)) for n in (3, 8, 13, 21)]
Step = tuple[str, int, int]


def steps(
    ops: Sequence[str], *, prompts: int = len(PROMPTS), max_size: int = 60
) -> st.SearchStrategy[list[Step]]:
    """Random steps: an op of `ops` (repeat one to weight it), a small n, a prompt index."""
    return st.lists(
        st.tuples(st.sampled_from(list(ops)), st.integers(0, 5), st.integers(0, prompts - 1)),
        min_size=1,
        max_size=max_size,
    )


def drive(
    core: Engine,
    ops: Sequence[Step],
    check: Callable[[], None],
    *,
    prompts: Sequence[list[int]] = PROMPTS,
    destination_max_tokens: Callable[[int], int] = lambda n: n + 1,
    cancelled: Callable[[int], str] = lambda n: f"r{n}",
    min_pass_ms: float = 0.0,
) -> float:
    """Apply `ops` (refused commands are skipped); returns the clock's `now_ms` at the end.

    `min_pass_ms` moves the clock on by at least that much per pass, so a pass that takes
    no modeled time still lets tier transfers land.
    """
    now = 0.0
    for op, n, prompt in ops:
        tokens = [*prompts[prompt], n]  # shared prefixes: cached, offloaded, onboarded
        command: Command | None = None
        match op:
            case "submit":
                command = Submit(Request(token_ids=tokens, max_tokens=n, request_id=f"r{n}"))
            case "cancel":
                command = Cancel(cancelled(n))
            case "reserve":
                request = Request(
                    token_ids=tokens, max_tokens=destination_max_tokens(n), request_id=f"d{n}"
                )
                command = ReserveDestination(f"h{n}", request)
            case "activate":
                command = ActivateDestination(f"h{n}")
            case "drop":
                command = CancelDestination(f"h{n}")
            case "pass":
                now = max(core.execute_pass(now).end_ms, now + min_pass_ms)
            case "wait":
                now += n  # tier transfers land while the rank idles
        if command is not None:
            with contextlib.suppress(CoreError):
                core.apply(command, now_ms=now)
        check()
    return now


def settle(core: Engine, now: float, check: Callable[[], None]) -> None:
    """Run the engine down from `now`, then cancel whatever is left, checking every step."""
    for _ in range(200):
        for handoff in list(core.parts.book.held.by_handoff):
            core.apply(ActivateDestination(handoff), now_ms=now)
        now = max(core.execute_pass(now).end_ms, now + 1.0)
        check()
    for handoff in [*core.queues().pending_destinations, *core.parts.book.held.by_handoff]:
        core.apply(CancelDestination(handoff), now_ms=now)
        check()
    queues = core.queues()
    for request_id in queues.waiting + queues.running + queues.parked:
        core.apply(Cancel(request_id), now_ms=now)
        check()
