"""`engined pause|resume|sleep|wake-up|release-kv-cache|set-weight-version|reset-prefix-cache`:
vLLM's engine-wide calls from a shell, for an operator of a shared daemon; and `engined cancel`.

Each sends one control message on an operator connection (the daemon's user on its ipc
endpoint, or an operator CURVE key) and shows every rank's state afterwards: its pause state,
whether it refuses new requests, what sleeps, and its weight version. `pause` and `sleep`
return once every rank's pause has completed, as vLLM's calls do, so `--timeout` bounds that
wait too. JSON mode prints one object per rank with the protocol's keys.

`cancel` ends requests by the ids their clients gave them (an operator's `cancel` reaches
anyone's; a connection without the role reaches only its own): each one's stream ends with a
`cancelled` terminal. It prints whether each was cancelled, and exits 1 when one was not
running (unknown, already ended, or, without the role, another client's), as `kill` does for
a process that is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engined.client import EngineClient, EngineError
from engined.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    Output,
    control_client,
    engine_failure,
    no_answer,
    zmq_context,
)
from engined.wire.control import Applied, RankStats, StatsReply

Call = Callable[[EngineClient, float], Awaitable[object]]

# vLLM's `PauseState` values, as `stats` carries them.
_PAUSE_STATES = {0: "running", 1: "paused (new requests held)", 2: "paused (all held)"}


@contextlib.asynccontextmanager
async def _operator(control_endpoint: str, timeout: float) -> AsyncIterator[EngineClient]:
    """A connection to the daemon, whose silence and refusals become the tools' errors."""
    async with zmq_context() as ctx, control_client(ctx, control_endpoint) as client:
        try:
            yield client
        except TimeoutError:
            raise no_answer(control_endpoint, timeout) from None
        except EngineError as error:
            raise engine_failure(error) from None


async def engine_call(control_endpoint: str, timeout: float, out: Output, call: Call) -> int:
    """Make `call` on an operator connection, then show every rank's state."""
    async with _operator(control_endpoint, timeout) as client:
        reply = await call(client, timeout)
        stats = reply if isinstance(reply, StatsReply) else await client.stats(timeout=timeout)
    for rank in stats.ranks:
        if out.json:
            out.record(state_record(rank))
        else:
            out.line(state_line(rank))
    return EXIT_OK


async def cancel_requests(
    control_endpoint: str, timeout: float, out: Output, request_ids: list[str]
) -> int:
    cancelled: list[bool] = []
    async with _operator(control_endpoint, timeout) as client:
        for request_id in request_ids:
            reply = await client.cancel(request_id, timeout=timeout)
            cancelled.append(isinstance(reply, Applied))
    for request_id, done in zip(request_ids, cancelled, strict=True):
        if out.json:
            out.record({"request_id": request_id, "cancelled": done})
        else:
            out.line(f"{request_id}: {'cancelled' if done else 'not running'}")
    return EXIT_OK if all(cancelled) else EXIT_FAILURE


def state_record(rank: RankStats) -> dict[str, Any]:
    return {
        "dp_rank": rank.dp_rank,
        "pause_state": rank.pause_state,
        "pause_pending": rank.pause_pending,
        "rejecting": rank.rejecting,
        "sleeping_tags": list(rank.sleeping_tags),
        "asleep": rank.asleep,
        "sleep_level": rank.sleep_level,
        "weight_version": rank.weight_version,
    }


def state_line(rank: RankStats) -> str:
    parts = [_PAUSE_STATES.get(rank.pause_state, str(rank.pause_state))]
    if rank.pause_pending:
        parts.append("pause pending")
    if rank.rejecting:
        parts.append("refusing new requests")
    if rank.asleep or rank.sleeping_tags:
        pools = ", ".join(rank.sleeping_tags) or "no pool"
        parts.append(f"asleep at level {rank.sleep_level} ({pools})")
    parts.append(f"weights {rank.weight_version!r}")
    return f"rank {rank.dp_rank}: " + "; ".join(parts)
