"""A dropped client's requests are cancelled in the order they were submitted.

The core's waiting queue is in submission order, so cancelling in that order takes each
request from the queue's front; any other order makes every cancel scan the queue, and a
client that vanishes with 20,000 queued requests froze the daemon for seconds
(benchmarks/abuse.py late-rank).
"""

from __future__ import annotations

import asyncio

from engined.core.types import Cancel
from engined.server.control.ownership import Ownership


class _Loop:
    """Records the commands sent to a rank instead of applying them."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def send(self, command: Cancel) -> None:
        self.cancelled.append(command.request_id)


def test_a_dropped_clients_requests_are_cancelled_in_submission_order() -> None:
    async def scenario() -> None:
        loops = [_Loop(), _Loop()]
        notified: list[tuple[int, list[str]]] = []
        ownership = Ownership(
            loops,  # type: ignore[arg-type]
            notify=lambda identity, rank, ids: notified.append((rank, list(ids))),
            released=lambda identity: None,
        )
        # Ids whose sorted order differs from the submission order.
        ids = ["z", "b", "y", "a", "x"]
        for i, request_id in enumerate(ids):
            assert ownership.claim(i % 2, request_id, b"client")
        assert ownership.end_client(b"client") == len(ids)
        assert loops[0].cancelled == ["z", "y", "x"]
        assert loops[1].cancelled == ["b", "a"]
        assert notified == [(0, ["z", "y", "x"]), (1, ["b", "a"])]

    asyncio.run(scenario())
