"""What a pass scheduled and preempted, in order: the vLLM parity harness's view (parity/).

Only an engine built with `record=True` produces one (`PassContext.trace`): the daemon
needs neither list, and building them would cost the hot decode pass a record per request.
"""

from __future__ import annotations

import msgspec


class ScheduledTokens(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One request's share of a pass: its computed tokens before it, the tokens it got."""

    request_id: str
    computed: int
    new: int


class PassTrace(msgspec.Struct, frozen=True):
    scheduled: list[ScheduledTokens]
    # Preemption victims in the order they were preempted (scheduling, then emission).
    preempted: list[str]
