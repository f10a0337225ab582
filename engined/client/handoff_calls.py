"""The disaggregation half of the control protocol: a handoff's source and destination calls
and the lifecycle events that report on them (protocol §1.7).

Apart from `EngineClient`'s other calls because only a prefill/decode split uses them (the
Dynamo worker, `engined.client.handoff_coordinator`, the handoff tools); `EngineClient`
inherits them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from engined.client.client_errors import ClientClosedError
from engined.client.dealer_connection import DEFAULT_TIMEOUT, Connection
from engined.wire.constraints import KvCacheReportMode
from engined.wire.control import (
    ActivateDestination,
    Applied,
    CancelDestination,
    CancelSource,
    DestinationAccepted,
    Noop,
    ReleaseSource,
    ReserveDestination,
    SubmitHandoffPrefill,
    Submitted,
    WireLifecycleEvent,
    WireLoraRequest,
    WireRequest,
)


class HandoffCalls(Connection):
    """The handoff calls of `EngineClient`, which is the class to use."""

    async def submit_handoff_prefill(
        self,
        handoff_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        seed: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Submitted:
        """Prefill on this (source) worker; `source_held` arrives as a lifecycle event."""
        request = wire_request(
            token_ids,
            max_tokens,
            request_id,
            output_token_ids,
            dp_rank,
            seed,
            priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        msg = SubmitHandoffPrefill(handoff_id=handoff_id, request=request, id=self._next_id())
        return await self._call_with_stream(msg, Submitted, request_id, timeout)

    async def release_source(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Free a held source; ends this client's lifecycle queue of the handoff."""
        msg = ReleaseSource(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def cancel_source(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        msg = CancelSource(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def reserve_destination(
        self,
        handoff_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        seed: int | None = None,
        priority: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> DestinationAccepted:
        """Reserve KV on this (destination) worker; `destination_reserved` follows as a
        lifecycle event, and the request's outputs stream after `activate_destination`."""
        request = wire_request(
            token_ids,
            max_tokens,
            request_id,
            output_token_ids,
            dp_rank,
            seed,
            priority,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        msg = ReserveDestination(handoff_id=handoff_id, request=request, id=self._next_id())
        return await self._call_with_stream(msg, DestinationAccepted, request_id, timeout)

    async def activate_destination(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Start decoding a reserved destination; ends this client's lifecycle queue of it."""
        msg = ActivateDestination(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def cancel_destination(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        msg = CancelDestination(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    # --- lifecycle events -----------------------------------------------------------------

    async def next_lifecycle(
        self, handoff_id: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> WireLifecycleEvent:
        """The next lifecycle event of `handoff_id`, or of any handoff when None.

        The two views are independent: an event is delivered once to its handoff's queue
        and once to the general feed (which keeps the newest LIFECYCLE_FEED_SIZE events).
        """
        if handoff_id is None:
            item = await self._get(self._lifecycle, timeout)
        else:
            queue = self._handoff_queue(handoff_id)
            item = await self._get(queue, timeout)
            if queue.empty() and self._handoffs.get(handoff_id) is queue:
                del self._handoffs[handoff_id]
        if isinstance(item, BaseException):
            raise item
        return item

    async def lifecycle_events(
        self, handoff_id: str | None = None, *, timeout: float | None = None
    ) -> AsyncIterator[WireLifecycleEvent]:
        """Yield lifecycle events (of one handoff, or all) until the client closes.

        `timeout` bounds the wait for each event (default: wait forever).
        """
        while True:
            try:
                yield await self.next_lifecycle(handoff_id, timeout=timeout)
            except ClientClosedError:
                return


def wire_request(
    token_ids: Sequence[int],
    max_tokens: int,
    request_id: str | None,
    output_token_ids: Sequence[int] | None,
    dp_rank: int | None,
    seed: int | None,
    priority: int = 0,
    *,
    stop_token_ids: Sequence[int] | None = None,
    min_tokens: int = 0,
    cache_salt: str | None = None,
    lora_request: WireLoraRequest | None = None,
    kv_cache_report_mode: KvCacheReportMode = "incremental",
) -> WireRequest:
    # NOTE: no validation here: the daemon is the one judge of a request, and tests send
    # invalid ones through these methods on purpose.
    return WireRequest(
        request_id=request_id,
        token_ids=list(token_ids),
        max_tokens=max_tokens,
        output_token_ids=None if output_token_ids is None else list(output_token_ids),
        dp_rank=dp_rank,
        seed=seed,
        priority=priority,
        stop_token_ids=None if stop_token_ids is None else list(stop_token_ids),
        min_tokens=min_tokens,
        cache_salt=cache_salt,
        lora_request=lora_request,
        kv_cache_report_mode=kv_cache_report_mode,
    )
