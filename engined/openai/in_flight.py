"""The engine requests this API server process runs, by vLLM's external request ids: what
vLLM's `POST /abort_requests` aborts.

vLLM's output processor knows each request by its external id (`cmpl-{id}-{prompt}` for a
completion's prompt, `chatcmpl-{id}` for a chat, the id a client chooses with `X-Request-Id`)
and aborts every request that shares the id it is given, the `n` samples of a prompt
included. Without ids it aborts everything it tracks and counts its request states (one per
unfinished sample) and its parent requests (one per prompt with `n` > 1 that still has an
unfinished sample). Each API server process has its own output processor, and so its own
registry here: an abort reaches only the requests of the process that received it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Protocol

from engined.client import EngineClient


class EngineRequest(Protocol):
    """One engine request of an OpenAI request (engined.openai.generation.Sample)."""

    @property
    def request_id(self) -> str: ...

    @property
    def external_id(self) -> str | None:
        """vLLM's external id, when it is not `request_id`."""
        ...

    @property
    def parallel(self) -> bool:
        """One of a prompt's n > 1 samples (a child of vLLM's ParentRequest)."""
        ...


class Running(Protocol):
    """An OpenAI request's engine requests (engined.openai.generation.Generation)."""

    def abortable(self, external_ids: Collection[str] | None) -> Sequence[EngineRequest]:
        """Those still running that `external_ids` names (None: all), now taken as aborted."""
        ...


class InFlight:
    """The running requests of one API server process (registered while they run)."""

    def __init__(self, client: EngineClient, *, timeout: float) -> None:
        self._client = client
        self._timeout = timeout
        self._running: set[Running] = set()

    def add(self, running: Running) -> None:
        self._running.add(running)

    def discard(self, running: Running) -> None:
        self._running.discard(running)

    async def abort(self, external_ids: Collection[str] | None) -> int:
        """Cancel the unfinished engine requests of `external_ids` (None: all of them); their
        streams end with vLLM's `abort` before this returns. Returns what vLLM's abort-all
        counts (its request states and parent requests); with ids, the caller counts.

        Raises:
            EngineError, TimeoutError, ConnectionError: a cancel the daemon refused or did
                not answer.
        """
        targets: list[str] = []
        parents: set[tuple[int, str]] = set()
        for running in list(self._running):
            for request in running.abortable(external_ids):
                targets.append(request.request_id)
                if request.parallel:
                    # Two requests may share an external id; each has its parent.
                    parents.add((id(running), request.external_id or request.request_id))
        results = await asyncio.gather(
            *(self._client.cancel(request_id, timeout=self._timeout) for request_id in targets),
            return_exceptions=True,
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
        return len(targets) + len(parents)
